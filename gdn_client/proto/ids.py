"""What a session id says on the wire: the server process it lives in, where a host runs several
(``gdn-server --processes K``): ``"p<index>.<random>"``. Both sides read it here: the server to
name a session's home, the client to follow it there. A server of one process gives ids without
the prefix."""
from __future__ import annotations

import re

_PROCESS = re.compile(r"p(\d+)\.")


def process_prefix(index: int) -> str:
    """The start of the ids of sessions that live in server process `index`."""
    return f"p{index}."


def process_of(session_id: str) -> int | None:
    """The server process a session id names, or None for an id of a server of one process.

    >>> process_of("p1.Xq3v"), process_of("Xq3v")
    (1, None)
    """
    match = _PROCESS.match(session_id)
    return int(match.group(1)) if match else None
