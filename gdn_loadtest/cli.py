"""gdn-loadtest's command line: runs, the table on stdout, JSON and charts on request."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import statistics
import sys
from pathlib import Path
from typing import Any, Sequence

from gdn_client import GdnError
from gdn_loadtest.config import LoadConfig, RunResult
from gdn_loadtest.echo import echo_server
from gdn_loadtest.report import format_table, pct_of_echo, pct_of_echo_by_point, write_plots
from gdn_loadtest.run import check_capacity, run_echo, run_load
from gdn_loadtest.shm import MODES
from gdn_server.tuning import tune_process
from gdn_loadtest.verify import VerificationError
from gdn_loadtest.workers import DTYPES

__all__ = ["build_parser", "main"]


def _clients_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--clients takes integers like 1,8,64, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"--clients needs positive integers, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gdn-loadtest",
        description="Concurrent decode load against a gdn-serve server, optionally next to a gRPC echo floor.",
    )
    p.add_argument("--target", default="127.0.0.1:50051", help="server address (default 127.0.0.1:50051)")
    p.add_argument("--clients", type=_clients_list, default=[1],
                   help="concurrent clients; a comma list runs each value in turn (e.g. 1,8,64)")
    p.add_argument("--mode", choices=["stream", "unary"], default="stream", help="DecodeStream or unary Decode")
    p.add_argument("--batch", type=int, default=1, help="sessions per request B (default 1)")
    p.add_argument("--tokens", type=int, default=1, help="tokens per step T (default 1)")
    p.add_argument("--layers-per-token", type=int, default=None, help="cycle only the first N layers")
    stop = p.add_mutually_exclusive_group()
    stop.add_argument("--duration", type=float, default=None, help="seconds per run (default 10)")
    stop.add_argument("--requests", type=int, default=None, help="steps per run, over all clients")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="input dtype on the wire")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    p.add_argument("--timeout", type=float, default=30.0, help="per-call deadline (s)")
    p.add_argument("--echo", action="store_true", help="also run the same load against a bytes echo server")
    p.add_argument("--rounds", type=int, default=1,
                   help="run each clients value this many times (with --echo: ours then the echo's, alternately)")
    p.add_argument("--processes", type=int, default=1,
                   help="spread each run's clients over this many load processes (default 1; one Python "
                        "load process costs ~40-60 us of CPU per step, so near 64 clients it can be the bound "
                        "itself: docs/performance.md)")
    p.add_argument("--shared-connection", action="store_true",
                   help="the clients of a load process share one TCP connection (HTTP/2 streams on it; grpc's "
                        "default for alike channels) instead of one connection each, as separate clients have")
    p.add_argument("--verify", action="store_true",
                   help="check every output of every step against the decode math done here (the client keeps "
                        "each session's state at each layer: clients x batch x layers x HV*V*K floats); a "
                        "mismatch fails the run. Costs client CPU per step: its figures are not throughput")
    p.add_argument("--server-seed", type=int, default=0,
                   help="with --verify: the --seed the server was started with (default 0, the server's "
                        "default), whose gate parameters A_log/dt_bias the check recomputes; a server started "
                        "with --weights cannot be verified")
    p.add_argument("--shared-memory", choices=MODES, default="none",
                   help="where the clients' tensors live: inline in the messages (none), or in a region of host "
                        "shared memory (system) or of this host's GPU (cuda) that the requests refer to; the "
                        "server must be on this host with --allow-shared-memory (default none)")
    p.add_argument("--speculative", action="store_true",
                   help="every step a draft of --tokens tokens; after each pass over the layers, a Commit of a "
                        "random 0..T of them for each session (speculative decoding)")
    p.add_argument("--json", type=Path, default=None, help="write results to this JSON file")
    p.add_argument("--plot", type=Path, default=None, help="write PNG charts into this folder")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (there is none either where stderr is not a terminal)")
    return p


def _argument_problem(args: argparse.Namespace) -> str | None:
    if min(args.batch, args.tokens, args.rounds, args.processes) < 1:
        return "--batch, --tokens, --rounds and --processes must be >= 1"
    if args.layers_per_token is not None and args.layers_per_token < 1:
        return "--layers-per-token must be >= 1"
    if args.speculative and args.verify:
        return "--verify follows plain steps only: not with --speculative"
    if args.verify and args.shared_memory != "none":
        return "--verify checks outputs that come in the reply: not with --shared-memory"
    if args.requests is not None and args.requests < 1:
        return "--requests must be >= 1"
    if (args.duration is not None and args.duration <= 0) or args.timeout <= 0:
        return "--duration and --timeout must be positive"
    return None


async def _run_all(args: argparse.Namespace, echo_address: str | None, results: list[RunResult]) -> None:
    """Per clients value and round: our run, then (with an echo address) the echo's run of the
    same message sizes right after it, so each pair sees the host in the same state. Appends each
    run to `results` as it ends, so a later failure leaves the finished ones there. First checks
    that the server has sessions for the largest clients value."""
    await check_capacity(args.target, max(args.clients), args.batch, args.timeout)
    for n in args.clients:
        for round_index in range(args.rounds):
            cfg = LoadConfig(
                target=args.target, clients=n, mode=args.mode, batch=args.batch, tokens=args.tokens,
                layers_per_token=args.layers_per_token, requests=args.requests, duration=args.duration,
                dtype=args.dtype, seed=args.seed, timeout=args.timeout, progress=not args.no_progress,
                shared_connection=args.shared_connection, verify=args.verify, server_seed=args.server_seed,
                shared_memory=args.shared_memory, speculative=args.speculative,
            )
            ours = dataclasses.replace(await run_load(cfg, args.processes), round=round_index)
            results.append(ours)
            if echo_address is None:
                continue
            echo = await run_echo(cfg, echo_address, ours.request_bytes, ours.reply_bytes, ours.layers_per_token,
                                  args.processes)
            results.append(dataclasses.replace(echo, round=round_index))


def results_document(args: argparse.Namespace, results: Sequence[RunResult]) -> dict[str, Any]:
    """What --json writes: the arguments, a summary per run (ours with `pct_of_echo`: its steps/s
    as % of the echo run after it) and per (mode, clients) every round's share and their median."""
    shares = pct_of_echo(results)
    doc: dict[str, Any] = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                           "runs": [], "pct_of_echo": []}
    for r in results:
        d = r.summary()
        share = shares.get((r.mode, r.clients, r.round)) if r.kind == "gdn" else None
        if share is not None:
            d["pct_of_echo"] = share
        doc["runs"].append(d)
    for (mode, clients), values in pct_of_echo_by_point(results).items():
        doc["pct_of_echo"].append({"mode": mode, "clients": clients, "rounds": values,
                                   "median": statistics.median(values)})
    return doc


def main(argv: Sequence[str] | None = None) -> int:
    tune_process()
    args = build_parser().parse_args(sys.argv[1:] if argv is None else list(argv))
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.duration is None and args.requests is None:
        args.duration = 10.0
    problem = _argument_problem(args)
    if problem is not None:
        print(f"gdn-loadtest: {problem}", file=sys.stderr)
        return 2
    results: list[RunResult] = []
    failure = None
    try:
        with echo_server() if args.echo else contextlib.nullcontext() as address:
            asyncio.run(_run_all(args, address, results))
    except GdnError as err:
        failure = f"gdn-loadtest: {err}"
    except VerificationError as err:
        failure = f"gdn-loadtest: --verify: a wrong output: {err}"
    if results:  # every run that finished, those before a failure too
        print(format_table(results))
    for r in results:
        for sample in r.error_samples:
            print(f"  {r.kind} x{r.clients} error: {sample}", file=sys.stderr)
    if args.json is not None and results:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results_document(args, results), indent=2))
    if args.plot is not None and results:
        for path in write_plots(results, args.plot):
            print(f"wrote {path}", file=sys.stderr)
    if failure is not None:
        print(failure, file=sys.stderr)
        return 1
    return 0 if all(r.errors == 0 for r in results) else 1
