"""The results as a table, as our throughput's share of the echo floor's, and as charts."""
from __future__ import annotations

import statistics
from pathlib import Path
from typing import Sequence

import numpy as np

from gdn_loadtest.config import Agreement, RunResult
from gdn_loadtest.verify import TOLERANCE_TEXT

__all__ = ["format_table", "pct_of_echo", "pct_of_echo_by_point", "write_plots"]


def format_table(results: Sequence[RunResult]) -> str:
    """A plain-text table, one row per run; each of our rows carries its throughput as % of the
    echo run that followed it (the echo rows leave that column empty). With speculative runs, the
    Commit round trip's p50 and p99 follow the step latency's (a pass's last step includes it)."""
    commits = any(r.speculative for r in results)
    header = ["kind", "mode", "clients", "B", "T", "steps", "steps/s", "tok*layers/s",
              "p50 ms", "p90 ms", "p99 ms", *(["commit p50 ms", "commit p99 ms"] if commits else []),
              "errors", "rows/launch", "% of echo"]
    shares = pct_of_echo(results)
    rows = []
    for r in results:
        lat, commit = r.latency_ms, r.commit_ms or {}
        share = shares.get((r.mode, r.clients, r.round)) if r.kind == "gdn" else None
        rows.append([
            r.kind, r.mode, str(r.clients), str(r.batch), str(r.tokens), str(r.steps),
            f"{r.steps_per_s:,.1f}", f"{r.token_layers_per_s:,.1f}",
            *(f"{lat[p]:.3f}" if p in lat else "-" for p in ("p50", "p90", "p99")),
            *(f"{commit[p]:.3f}" if p in commit else "-" for p in (("p50", "p99") if commits else ())),
            str(r.errors), f"{r.server['mean_rows_per_launch']:.2f}" if r.server else "-",
            "" if share is None else f"{share:.1f}%",
        ])
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    for (mode, clients), values in pct_of_echo_by_point(results).items():
        if len(values) > 1:
            lines.append(f"{mode} x{clients}: median {statistics.median(values):.1f}% of echo over "
                         f"{len(values)} rounds ({', '.join(f'{v:.1f}' for v in values)})")
    agreement = Agreement.merge(r.agreement for r in results if r.verified)
    if agreement is not None:
        lines.append(f"--verify: all {agreement.outputs:,} output numbers matched the reference math within "
                     f"{TOLERANCE_TEXT}; the largest error was {100 * agreement.max_error:.3g}% of its head's "
                     f"largest output, {100 * agreement.max_share:.3g}% of the error allowed there")
    return "\n".join(lines)


def pct_of_echo(results: Sequence[RunResult]) -> dict[tuple[str, int, int], float]:
    """Our steps/s as % of the echo's, per (mode, clients, round): each run of ours against the
    echo run that followed it."""
    echoes = {(r.mode, r.clients, r.round): r for r in results if r.kind == "echo"}
    shares = {}
    for r in results:
        key = (r.mode, r.clients, r.round)
        if r.kind == "gdn" and key in echoes and echoes[key].steps_per_s:
            shares[key] = 100.0 * r.steps_per_s / echoes[key].steps_per_s
    return shares


def pct_of_echo_by_point(results: Sequence[RunResult]) -> dict[tuple[str, int], list[float]]:
    """Every round's % of echo, per (mode, clients), in round order."""
    by_point: dict[tuple[str, int], list[float]] = {}
    for (mode, clients, _), share in sorted(pct_of_echo(results).items(), key=lambda kv: kv[0][2]):
        by_point.setdefault((mode, clients), []).append(share)
    return by_point


def write_plots(results: Sequence[RunResult], directory: Path) -> list[Path]:
    """Throughput against concurrency (when several clients values ran) and latency CDFs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    written = []
    by_kind: dict[str, list[RunResult]] = {}
    for r in results:
        by_kind.setdefault(f"{r.kind} {r.mode}", []).append(r)
    if len({r.clients for r in results}) > 1:
        fig, ax = plt.subplots(figsize=(6, 4))
        for label, rs in by_kind.items():
            rs = sorted(rs, key=lambda r: r.clients)
            repeated = len({r.clients for r in rs}) < len(rs)  # --rounds: a point per round, no line
            ax.plot([r.clients for r in rs], [r.steps_per_s for r in rs], marker="o", label=label,
                    linestyle="none" if repeated else "-")
        ax.set_xscale("log", base=2)
        ticks = sorted({r.clients for r in results})
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel("steps/s")
        ax.set_title(f"throughput (B={results[0].batch}, T={results[0].tokens})")
        ax.grid(True, alpha=0.3)
        ax.legend()
        path = directory / "throughput_vs_clients.png"
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in results:
        if not r.latencies_ms:
            continue
        lat = np.sort(np.asarray(r.latencies_ms))
        label = f"{r.kind} {r.mode} x{r.clients}" + (f" round {r.round}" if r.round else "")
        ax.plot(lat, np.arange(1, lat.size + 1) / lat.size, label=label)
    ax.set_xscale("log")
    ax.set_xlabel("latency per step (ms)")
    ax.set_ylabel("fraction of steps")
    ax.set_title("latency CDF")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    path = directory / "latency_cdf.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    written.append(path)
    return written
