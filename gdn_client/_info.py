"""What the client reports of a server: `ModelInfo`, `DeviceInfo` and `Stats`, read from their
protobuf messages (for both clients; no I/O here)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, TypeVar

from gdn_client.proto.gdn.v1 import gdn_pb2

__all__ = ["ModelInfo", "DeviceInfo", "Stats", "model_info_from_proto", "stats_from_proto"]


@dataclass(frozen=True)
class ModelInfo:
    """The served model's shape (mirrors ``gdn.v1.ModelInfo``)."""

    num_layers: int
    num_q_heads: int
    num_v_heads: int
    head_dim_k: int
    head_dim_v: int
    max_tokens_per_step: int
    max_sessions: int
    sessions_in_use: int
    backend: str
    state_dtype: str
    scale: float
    max_speculative_tokens: int = 0
    devices: tuple["DeviceInfo", ...] = ()  # capacity per device (one per GPU; one for the CPU)
    # several server processes on one host (gdn-server --processes): every process's port, in
    # process order, and the target's place among them; () and 0 for a server of one process
    process_ports: tuple[int, ...] = ()
    process_index: int = 0
    shared_memory: bool = False  # whether the server takes shared-memory regions (--allow-shared-memory)


@dataclass(frozen=True)
class DeviceInfo:
    """One device of the server (mirrors ``gdn.v1.DeviceInfo``)."""

    index: int
    name: str
    max_sessions: int
    sessions_in_use: int


@dataclass(frozen=True)
class Stats:
    """Server counters (mirrors ``gdn.v1.Stats``); take deltas between two snapshots."""

    launches: int
    rows_launched: int
    requests: int
    batches: int
    mean_rows_per_launch: float
    sessions_in_use: int
    max_sessions: int
    backend: str
    device_seconds: float = 0.0  # summed submit-to-result time of backend calls
    queue_wait_seconds: float = 0.0  # summed time requests waited before their launch

    def since(self, before: "Stats") -> "Stats":
        """The counters accumulated between ``before`` and this snapshot."""
        launches = self.launches - before.launches
        rows = self.rows_launched - before.rows_launched
        return dataclasses.replace(
            self,
            launches=launches,
            rows_launched=rows,
            requests=self.requests - before.requests,
            batches=self.batches - before.batches,
            mean_rows_per_launch=rows / launches if launches else 0.0,
            device_seconds=self.device_seconds - before.device_seconds,
            queue_wait_seconds=self.queue_wait_seconds - before.queue_wait_seconds,
        )


_T = TypeVar("_T")


def _from_proto(cls: type[_T], msg: Any) -> _T:
    return cls(**{f.name: getattr(msg, f.name) for f in dataclasses.fields(cls)})  # type: ignore[arg-type]


def model_info_from_proto(msg: gdn_pb2.ModelInfo, *others: gdn_pb2.ModelInfo) -> ModelInfo:
    """`msg` as a `ModelInfo`; with the ModelInfo of the host's other server processes
    (`others`), the sessions and capacity are those of the whole host: summed over the processes,
    per device too (the processes of one device share it)."""
    repeated = ("devices", "process_ports")
    fields = {f.name: getattr(msg, f.name) for f in dataclasses.fields(ModelInfo) if f.name not in repeated}
    devices: dict[tuple[int, str], DeviceInfo] = {}
    for info in (msg, *others):
        for d in info.devices:
            seen = devices.get((d.index, d.name))
            devices[(d.index, d.name)] = _from_proto(DeviceInfo, d) if seen is None else dataclasses.replace(
                seen, max_sessions=seen.max_sessions + d.max_sessions,
                sessions_in_use=seen.sessions_in_use + d.sessions_in_use,
            )
    fields["max_sessions"] = sum(info.max_sessions for info in (msg, *others))
    fields["sessions_in_use"] = sum(info.sessions_in_use for info in (msg, *others))
    return ModelInfo(**fields, devices=tuple(devices.values()), process_ports=tuple(msg.process_ports))


def stats_from_proto(msg: gdn_pb2.Stats) -> Stats:
    return _from_proto(Stats, msg)
