"""Busy polling: the event loop keeps running for a while after it answers, instead of sleeping.

A client that steps one session through its layers sends its next request right after each
reply. Between the two, an idle event loop blocks in epoll; the next request then finds a thread
that has to be woken and caches gone cold, and the whole step runs slower (bench/NOTES.md: at one
client, p50 0.55 -> 0.31 ms on the 2-core CPU box with a host-only backend; the host work of the
same step run hot takes a fraction of what it takes cold). The kernel's `net.core.busy_poll` does
the same for sockets. On the H200 host it gained nothing while a step's own server work was
~1 ms cold (p50 0.77-0.79 ms, seventh session); once that work was ~150 us, a 1 ms window cut one
client's p50 by 13-24% (eighteenth session), and it became the default (SchedulerConfig.busy_poll_us).

`LoopSpinner.touch()` (the scheduler calls it after each round of answers) keeps a callback on
the loop's ready queue for `window_s`, so every loop iteration polls its sockets with a zero
timeout. Past the window with nothing answered, the loop sleeps again: an idle server costs no
CPU. While it spins it costs one core, which is why it is only for schedulers on the event loop
(a GPU backend; a thread scheduler computing on the host would compete with the spinning loop
for the GIL); `--busy-poll-us 0` turns it off.

A `--frontends` worker touches its loop's spinner after each request it hands to an engine and
each reply it reads (gdn_server.frontend.EngineLinkClient), while its link carries one request
at a time: a worker of several busy clients is awake anyway, and spinning through its lulls took
cores from the rest on the CPU box. On the H200 host one client behind eight workers went from a
p50 of 0.52-0.77 to 0.38-0.40 ms, with 8 and 64 clients even or faster (twentieth session).
"""
from __future__ import annotations

import asyncio
import time
import weakref

_SPINNERS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, "LoopSpinner"] = weakref.WeakKeyDictionary()


class LoopSpinner:
    """Keeps `loop` from sleeping for `window_s` after each `touch()`. Use on the loop's thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, window_s: float) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self._loop = loop
        self.window_s = window_s
        self._until = 0.0
        self.spinning = False

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop, window_s: float) -> "LoopSpinner":
        """The loop's spinner (one per loop, shared by every scheduler on it: one spin callback,
        not one per device); its window is the longest asked for."""
        spinner = _SPINNERS.get(loop)
        if spinner is None:
            spinner = _SPINNERS[loop] = cls(loop, window_s)
        spinner.window_s = max(spinner.window_s, window_s)
        return spinner

    def touch(self) -> None:
        """Something was answered: keep polling for the next request for another window."""
        self._until = time.monotonic() + self.window_s
        if not self.spinning:
            self.spinning = True
            self._loop.call_soon(self._spin)

    def _spin(self) -> None:
        # a ready callback makes the loop's next select use a zero timeout: the loop polls its
        # sockets (and the device, through the scheduler's own callbacks) without sleeping
        if time.monotonic() < self._until:
            self._loop.call_soon(self._spin)
        else:
            self.spinning = False
