"""The progress bar of a run: tqdm on stderr, with the run's known total, so it shows an ETA.

A run's end is known before it starts: its duration (the bar counts seconds, with the steps so
far and their rate beside it) or its number of steps (the bar counts steps). The bar is shown
only where stderr is a terminal and progress is asked for; a run's loop never touches it per
step: a ticker hands it the step count a few times a second.
"""
from __future__ import annotations

import sys
from typing import IO, Protocol

from tqdm import tqdm

from gdn_loadtest.config import LoadConfig

__all__ = ["ProgressSink", "ProgressBar", "REFRESH_S"]

REFRESH_S = 0.25


class ProgressSink(Protocol):
    def show(self, steps: int, elapsed: float) -> None: ...

    def close(self) -> None: ...


class ProgressBar:
    """tqdm over a run's seconds (a duration run) or its steps (a run of so many steps)."""

    def __init__(self, cfg: LoadConfig, label: str, file: IO[str] | None = None) -> None:
        self.duration = cfg.duration
        common = dict(desc=label, file=file or sys.stderr, leave=False, mininterval=0.0,
                      disable=None if cfg.progress else True)  # None: off where the file is no terminal
        if self.duration is not None:
            self.bar = tqdm(total=self.duration, unit="s", **common,
                            bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.1f}/{total:.1f} s "
                                       "[{elapsed}<{remaining}{postfix}]")
        else:
            self.bar = tqdm(total=cfg.requests, unit="step", **common)

    def show(self, steps: int, elapsed: float) -> None:
        if self.bar.disable:
            return
        if self.duration is not None:
            self.bar.n = min(elapsed, self.duration)
            rate = steps / elapsed if elapsed > 0 else 0.0
            self.bar.set_postfix_str(f"{steps:,} steps, {rate:,.0f} steps/s", refresh=False)
        elif steps == self.bar.n:
            return  # the rate shown stays the one of the last step, not of waiting for the results
        else:
            self.bar.n = steps
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()
