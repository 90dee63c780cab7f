"""--batch-fill: hold a launch under load until a share of the server's clients have their rows queued.

Clients of a decode server run closed loops: each session sends its next step once the last one
is answered. Under load a launch therefore takes whatever arrived since the previous one, and
how many rows that is depends on when the loop happens to run a round, not on how many clients
there are (bench/NOTES.md, twenty-first session: 26-30 rows per launch at 64 clients on the H200).
This policy holds a round until the queue holds `fraction` of the rows in circulation, for at
most `max_hold_s` after the oldest request queued.

The rows in circulation are not known to the scheduler (clients, streams and layers come and
go), so they are estimated with Little's law: rows in the system = arrival rate x the time
each row takes to come back. The rate is rows launched per second; the time is, for one
sampled session per launch, the gap since that session's previous step (Session.last_used,
which the scheduler sets at every step, so sampling costs no per-row work). One client stepping
its layers one at a time estimates to 1 and is never held; 64 such clients estimate to ~64.

A session that steps rarely (a client thinking between requests) would count as a whole client
while contributing almost no rows, so each sampled gap is capped at `gap_cap_s`: a session
slower than that counts in proportion to how often it steps within the cap.

Below `min_rows` in circulation there is no hold at all. There a round's wait costs its clients
latency the loop had time to spare for: on the H200, one process at 8 clients ran 2-13% fewer
steps/s with a hold of 0.5 (bench/NOTES.md, twenty-third session), while from 64 clients up the
loop is saturated and a hold costs nothing there.
"""
from __future__ import annotations

# how long the rate and gap samples are gathered before each new estimate (at 64 clients on the
# H200, ~4 launches)
ESTIMATE_PERIOD_S = 0.01
# a period this many times longer than ESTIMATE_PERIOD_S had an idle spell in it: its estimate
# replaces the old one instead of being averaged with it
IDLE_PERIODS = 4
# a sampled gap counts at most this long (see the module docstring)
GAP_CAP_S = 0.02


class BatchFill:
    """The estimate and the hold decision. One per scheduler, used on its thread only."""

    def __init__(self, fraction: float, max_hold_s: float, min_rows: float = 0.0, gap_cap_s: float = GAP_CAP_S,
                 period_s: float = ESTIMATE_PERIOD_S) -> None:
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"fraction must be in [0, 1], got {fraction}")
        if max_hold_s < 0:
            raise ValueError(f"max_hold_s must be >= 0, got {max_hold_s}")
        if min_rows < 0:
            raise ValueError(f"min_rows must be >= 0, got {min_rows}")
        self.fraction = fraction
        self.max_hold_s = max_hold_s
        self.min_rows = min_rows
        self.gap_cap_s = gap_cap_s
        self.period_s = period_s
        self.rows_in_circulation = 0.0  # the latest estimate (0 until the first period ends)
        self._period_start: float | None = None
        self._period_rows = 0
        self._gap_sum = 0.0
        self._gaps = 0

    @property
    def enabled(self) -> bool:
        return self.fraction > 0.0 and self.max_hold_s > 0.0

    def target_rows(self) -> float:
        """Rows a launch waits for (within the hold): `fraction` of the estimate."""
        return self.fraction * self.rows_in_circulation

    def launched(self, rows: int, sampled_gap_s: float | None, now: float) -> None:
        """Records a launch of `rows` at `now`, with the gap since one of its sessions' previous
        step (None when no session of it had stepped before)."""
        start = self._period_start
        if start is None:
            self._period_start = now  # the rate counts rows after this first launch
            return
        self._period_rows += rows
        if sampled_gap_s is not None and sampled_gap_s >= 0:
            self._gap_sum += min(sampled_gap_s, self.gap_cap_s)
            self._gaps += 1
        elapsed = now - start
        if elapsed < self.period_s or not self._gaps:
            return
        # Little's law over the period; after an idle spell the period is long and the rate low,
        # so the estimate falls back at once instead of holding the first requests of a new burst
        estimate = (self._period_rows / elapsed) * (self._gap_sum / self._gaps)
        previous = self.rows_in_circulation
        fresh = previous == 0.0 or elapsed > IDLE_PERIODS * self.period_s
        self.rows_in_circulation = estimate if fresh else 0.5 * (previous + estimate)
        self._period_start = now
        self._period_rows = 0
        self._gap_sum = 0.0
        self._gaps = 0

    def hold_s(self, pending_rows: int, oldest_enqueued: float, now: float) -> float:
        """How much longer a round should wait for more rows: 0 to launch now."""
        target = self.target_rows()
        if pending_rows >= target or target < 2.0:  # nothing to gain by waiting for one more row
            return 0.0
        if self.rows_in_circulation < self.min_rows:  # too few clients to saturate the loop
            return 0.0
        return max(0.0, self.max_hold_s - (now - oldest_enqueued))
