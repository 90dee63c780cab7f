"""Which asyncio event loop the server's processes run on.

Every process of the server (gdn-server, each engine, each front-end worker, the router) runs
one asyncio loop that serves gRPC, and under load that loop's thread is the bound (bench/NOTES.md:
at 64 streaming clients it is 96% busy, ~40 us of each step's ~110 us being gRPC's own work).
uvloop (libuv under asyncio's API) runs the loop's own machinery (the ready queue, the selector,
call_soon and the self-pipe wake-ups from gRPC's poller thread) in C. grpc.aio runs on any asyncio
loop.

`--event-loop auto` (the default) takes uvloop where it is installed (Linux and macOS wheels;
a dependency of the package there) and the standard loop elsewhere; `asyncio` and `uvloop` force
one (uvloop missing: an error at start, not a silent fallback).
"""
from __future__ import annotations

import asyncio
import sys
from typing import Any, Callable, Coroutine, TypeVar

EVENT_LOOPS = ("auto", "uvloop", "asyncio")
T = TypeVar("T")


def loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The new-loop function for `choice` (one of EVENT_LOOPS); None: asyncio's own loop."""
    if choice not in EVENT_LOOPS:
        raise ValueError(f"event loop must be one of {', '.join(EVENT_LOOPS)}, got {choice!r}")
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise RuntimeError("--event-loop uvloop: uvloop is not installed (pip install uvloop)") from None
        return None
    return uvloop.new_event_loop


def loop_name(choice: str) -> str:
    """What `run(..., choice)` runs on: "uvloop" or "asyncio"."""
    return "asyncio" if loop_factory(choice) is None else "uvloop"


def running_loop_name() -> str:
    """What the running loop is: "uvloop" or "asyncio" (the servers log it once they listen)."""
    return type(asyncio.get_running_loop()).__module__.split(".")[0]


def run(main: Coroutine[Any, Any, T], choice: str = "auto") -> T:
    """`asyncio.run(main)` on the loop `choice` names."""
    factory = loop_factory(choice)
    if factory is None:
        return asyncio.run(main)
    if sys.version_info >= (3, 11):
        with asyncio.Runner(loop_factory=factory) as runner:
            return runner.run(main)
    import uvloop  # Python 3.10: no Runner; the policy makes asyncio.run's loop a uvloop one

    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    try:
        return asyncio.run(main)
    finally:
        asyncio.set_event_loop_policy(None)
