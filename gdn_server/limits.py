"""Every bound on what a client can make the server hold, in one place.

docs/operations.md's "Limits" table states each default here, and tests/test_limits_doc.py holds
the two to each other: a bound added here is documented there, or that test fails.
"""
from __future__ import annotations

from dataclasses import dataclass

from gdn_server.config import ModelShape

# What one held call costs the server (an idle DecodeStream that has answered one step, as RSS over
# 4096 of them: tests/test_admission.py); --max-calls defaults to what CALL_MEMORY_BUDGET holds of them.
CALL_COST_BYTES = 72 << 10
CALL_MEMORY_BUDGET = 512 << 20

# A DecodeStream reads ahead of its replies (so one stream is pipelined) by at most this many requests
# and input bytes, so a client that sends fast and never reads its replies holds a bounded amount.
MAX_STREAM_IN_FLIGHT = 64
MAX_STREAM_HELD_BYTES = 16 << 20
# Input bytes of decode requests held at once (parsed, awaiting their answer) over all calls; beyond
# it a request is refused with RESOURCE_EXHAUSTED, so many clients cannot pile up big requests.
MAX_HELD_REQUEST_BYTES = 512 << 20
MAX_CHUNKS_READ_AFTER_ERROR = 16  # ImportState: chunks drained after a bad one, before the error reply
MAX_CHUNK_BYTES = 1 << 20  # one chunk of an imported or exported state stream
MAX_EVICTED_IDS = 65536  # evicted ids remembered (oldest forgotten first), to answer why they are gone
MAX_SESSION_ID_LEN = 128
MAX_REQUEST_ID_LEN = 256
MAX_REGION_NAME_LEN = 128  # a shared-memory region's name (a POSIX shm name or a CUDA IPC label)
# request layouts (resolved references) a client's shared-memory resolver remembers: a client
# steps through a model with a few sets of tensors, each a layout; past this many all are forgotten
MAX_LAYOUTS_PER_CLIENT = 256
SPECULATIVE_TIMEOUT_S = 60.0  # open drafts of a session unused this long are dropped (--speculative-timeout-s)
# A message's room beyond its largest inputs, for the ids and positions of the sessions it names.
MESSAGE_ROOM_BYTES = 1 << 20
MESSAGE_MIN_ROWS = 256  # a message may hold this many rows even where --max-batch-rows is lower


@dataclass(frozen=True)
class Limits:
    """What one client can make the server hold, beyond its state pool. Each is a flag; the
    defaults keep a server's memory for unfinished or unread messages under about 1 GiB
    (docs/operations.md works the figures out)."""

    max_calls: int = CALL_MEMORY_BUDGET // CALL_COST_BYTES  # calls held at once over all clients (health aside)
    max_calls_per_client: int = 1024  # calls one client (identity, else connection) may hold at once
    message_timeout_s: float = 10.0  # a unary call's request must arrive whole within this
    max_streams_per_connection: int = 128  # HTTP/2 streams one connection may have open
    max_connections: int = 1024  # client connections at once; more are refused
    idle_connection_timeout_s: float = 600.0  # a connection with no call for this long is closed

    def __post_init__(self) -> None:
        for name in ("max_calls", "max_calls_per_client", "max_streams_per_connection", "max_connections"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.message_timeout_s > 0:
            raise ValueError(f"message_timeout_s must be > 0, got {self.message_timeout_s}")
        if not self.idle_connection_timeout_s > 0:
            raise ValueError(f"idle_connection_timeout_s must be > 0, got {self.idle_connection_timeout_s}")


@dataclass(frozen=True)
class SharedMemoryLimits:
    """What one caller may map through RegisterSharedMemory, where --allow-shared-memory is on
    (docs/operations.md, limits). Without auth a caller is a connection."""

    max_regions_per_client: int = 16
    max_bytes_per_client: int = 4 << 30  # bytes registered at once, over the caller's regions
    idle_s: float = 60.0  # a region no request has used for this long is unmapped (--shared-memory-idle-s)

    def __post_init__(self) -> None:
        if self.max_regions_per_client < 1 or self.max_bytes_per_client < 1:
            raise ValueError("shared-memory bounds must be >= 1")
        if not self.idle_s > 0:
            raise ValueError(f"idle_s must be > 0, got {self.idle_s}")


def max_message_bytes(shape: ModelShape, max_batch_rows: int) -> int:
    """The largest request a client may send: max(max_batch_rows, MESSAGE_MIN_ROWS) rows of float32
    inputs at the largest T, plus MESSAGE_ROOM_BYTES for the ids and positions of that many sessions."""
    per_token = 4 * (2 * shape.num_q_heads * shape.head_dim_k + shape.num_v_heads * (shape.head_dim_v + 2))
    rows = max(max_batch_rows, MESSAGE_MIN_ROWS)
    # gRPC's message-length options are signed 32-bit
    return min(per_token * shape.max_speculative_tokens * rows + MESSAGE_ROOM_BYTES, 2**31 - 1)
