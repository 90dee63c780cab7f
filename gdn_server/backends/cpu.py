"""CPU backend ("cpu-torch"): the reference the GPU backend is checked against, and the default on
machines without a GPU. The pool is a bf16 tensor in host memory; each step gathers the rows'
states, runs the fp32 math of `torch_math` and scatters them back rounded to bf16 once."""
from __future__ import annotations

import torch

from gdn_server.backends.base import Backend, DoneStep, PendingStep, check_unchecked_inputs
from gdn_server.backends.torch_math import gdn_step_fp32
from gdn_server.config import ModelShape
from gdn_server.weights import GateParams
from gdn_server.work import INPUT_NAMES, StepBatch


class CpuBackend(Backend):
    name = "cpu-torch"

    def __init__(
        self, shape: ModelShape, gates: GateParams, max_sessions: int, scale: float | None = None,
        speculative_sessions: int | None = None,
    ) -> None:
        super().__init__(shape, gates, max_sessions, scale, speculative_sessions)
        HV, V, K = shape.num_v_heads, shape.head_dim_v, shape.head_dim_k
        self.state_pool = torch.zeros(self.pool_rows, HV, V, K, dtype=torch.bfloat16)
        self.A_log = gates.A_log.float().contiguous()
        self.dt_bias = gates.dt_bias.float().contiguous()

    def submit(self, batch: StepBatch) -> PendingStep:
        check_unchecked_inputs(batch)
        slots = torch.tensor(batch.slots, dtype=torch.long)
        layers = torch.tensor(batch.layers, dtype=torch.long)
        state = self.state_pool.index_select(0, slots).float()
        out = gdn_step_fp32(
            state,
            *(torch.cat(batch.inputs(name)) for name in INPUT_NAMES),
            self.A_log.index_select(0, layers),
            self.dt_bias.index_select(0, layers),
            self.scale,
        )
        # written only after the whole step succeeded: a failure leaves every state unchanged
        out_slots = slots if batch.in_place else torch.tensor(batch.out_slots, dtype=torch.long)
        self.state_pool.index_copy_(0, out_slots, state.to(torch.bfloat16))
        return DoneStep(out.to(torch.bfloat16))

    def _rows(self, session_slot: int) -> slice:
        L = self.shape.num_layers
        return slice(session_slot * L, (session_slot + 1) * L)

    def reset_session(self, session_slot: int) -> None:
        self.state_pool[self._rows(session_slot)].zero_()

    def copy_session(self, src_slot: int, dst_slot: int) -> None:
        self.state_pool[self._rows(dst_slot)].copy_(self.state_pool[self._rows(src_slot)])

    def read_session(self, session_slot: int) -> torch.Tensor:
        return self.state_pool[self._rows(session_slot)].clone()

    def write_session(self, session_slot: int, state: torch.Tensor) -> None:
        self.state_pool[self._rows(session_slot)].copy_(state)

    def copy_rows(self, src_rows: list[int], dst_rows: list[int]) -> None:
        src = self.state_pool.index_select(0, torch.tensor(src_rows, dtype=torch.long))
        self.state_pool.index_copy_(0, torch.tensor(dst_rows, dtype=torch.long), src)
