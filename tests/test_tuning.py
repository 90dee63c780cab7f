"""Process tuning at start (gdn_server.tuning): start-up objects frozen out of the collector."""
from __future__ import annotations

import subprocess
import sys


def test_freezing_start_up_objects_takes_them_out_of_the_collectors_passes():
    """gdn_server.tuning.freeze_startup_objects, in a fresh process (gc.freeze is process-wide):
    after it, a full collection walks only what was made since, not torch's ~10^5 objects."""
    code = (
        "import gc, torch, gdn_server.server\n"
        "from gdn_server.tuning import freeze_startup_objects\n"
        "before = len(gc.get_objects())\n"
        "frozen = freeze_startup_objects()\n"
        "after = len(gc.get_objects())\n"
        "assert frozen >= before // 2 and after < before // 10, (before, frozen, after)\n"
        "print('ok', before, frozen)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("ok"), out.stderr


def test_importing_the_server_changes_nothing_in_the_environment():
    """No environment variable is set or changed by importing any server module (torch's thread
    pool and gRPC's I/O read theirs when they load: an import must not choose for the operator)."""
    code = (
        "import os, json\n"
        "before = dict(os.environ)\n"
        "import gdn_server, gdn_server.cli, gdn_server.server, gdn_server.backends.cpu\n"
        "print(json.dumps({k: v for k, v in os.environ.items() if before.get(k) != v}))\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("OMP_WAIT_POLICY", "GRPC_EXPERIMENTS")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "{}"


def test_a_server_process_starts_with_the_raised_threshold():
    """gdn-server's entry point calls it before it serves: its --help path runs the same start
    (a real process, nothing mocked)."""
    code = (
        "import gc, sys\n"
        "from gdn_server import cli\n"
        "try:\n"
        "    cli.main(['--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "print('threshold', gc.get_threshold()[0], file=sys.stderr)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "threshold 20000" in out.stderr, out.stderr
