"""DecodeRequest (protobuf) -> DecodeWork (validated tensors). Everything a request can get wrong
on its own (without looking at session state) is caught here as InvalidArgument."""
from __future__ import annotations

from gdn_client.proto.gdn.v1 import gdn_pb2
from gdn_client.wire import WireFormatError, tensor_from_parts
from gdn_server.config import ModelShape
from gdn_server.errors import InvalidArgument
from gdn_server.work import DecodeWork

MAX_SESSION_ID_LEN = 128


def decode_work_from_request(req: gdn_pb2.DecodeRequest, shape: ModelShape) -> DecodeWork:
    """Validates a DecodeRequest against the model shape; raises InvalidArgument with a precise reason."""
    L, H, HV, K, V = (shape.num_layers, shape.num_q_heads, shape.num_v_heads, shape.head_dim_k, shape.head_dim_v)
    if req.layer >= L:
        raise InvalidArgument(f"layer {req.layer} out of range: the model has {L} layers (0..{L - 1})")
    session_ids = tuple(req.session_ids)
    B = len(session_ids)
    if B == 0:
        raise InvalidArgument("session_ids is empty: a request names at least one session")
    if len(set(session_ids)) != B:
        raise InvalidArgument("duplicate session ids in one request")
    lengths = tuple(map(len, session_ids))  # one C-level pass; the loop below runs only on a bad id
    if min(lengths) == 0 or max(lengths) > MAX_SESSION_ID_LEN:
        for sid in session_ids:
            if not sid or len(sid) > MAX_SESSION_ID_LEN:
                raise InvalidArgument(f"malformed session id {sid[:MAX_SESSION_ID_LEN]!r}")

    tensors = {}
    raw: list[bytes | None] = []
    for name in ("q", "k", "v", "a", "b"):
        if not req.HasField(name):
            raise InvalidArgument(f"tensor {name} is missing")
        try:
            msg = getattr(req, name)
            data = msg.data  # a fresh bytes object per access: read it once
            tensors[name] = tensor_from_parts(msg.dtype, tuple(msg.shape), data, name, finite=True)
            raw.append(data if msg.dtype == gdn_pb2.BF16 else None)
        except WireFormatError as e:
            raise InvalidArgument(str(e)) from None

    q = tensors["q"]
    if q.dim() != 4:
        raise InvalidArgument(f"q must be [B, T, H, K] = [{B}, T, {H}, {K}], got {list(q.shape)}")
    T = int(q.shape[1])
    max_T = shape.max_speculative_tokens if req.speculative else shape.max_tokens_per_step
    if not 1 <= T <= max_T:
        kind = "speculative step" if req.speculative else "step"
        raise InvalidArgument(f"T = {T} tokens per {kind} is out of range 1..{max_T}")
    expected = {
        "q": (B, T, H, K),
        "k": (B, T, H, K),
        "v": (B, T, HV, V),
        "a": (B, T, HV),
        "b": (B, T, HV),
    }
    for name, want in expected.items():
        got = tuple(tensors[name].shape)
        if got != want:
            raise InvalidArgument(f"{name} must have shape {list(want)} (B={B}, T={T}), got {list(got)}")

    positions = None
    if len(req.positions):
        if len(req.positions) != B:
            raise InvalidArgument(f"positions has {len(req.positions)} entries for {B} sessions")
        positions = tuple(req.positions)  # uint64 fields read as Python ints already

    return DecodeWork(
        layer=int(req.layer),
        session_ids=session_ids,
        positions=positions,
        request_id=req.request_id,
        speculative=bool(req.speculative),
        bf16_bytes=tuple(raw) if all(r is not None for r in raw) else None,
        **tensors,
    )
