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


def _first_threshold_in_a_fresh_process(env_value: str | None) -> subprocess.CompletedProcess:
    import os

    env = {k: v for k, v in os.environ.items() if k != "GDN_GC_GEN0"}
    if env_value is not None:
        env["GDN_GC_GEN0"] = env_value
    code = (
        "import gc\n"
        "from gdn_server.tuning import tune_gc\n"
        "set_to = tune_gc()\n"
        "print(set_to, *gc.get_threshold())\n"
    )
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_the_collectors_first_threshold_is_raised_above_a_servers_objects_in_flight():
    """tune_gc (every server process, the echo floor and gdn-loadtest call it at start) sets the
    first threshold to 20,000 by default or to GDN_GC_GEN0, and leaves the older generations'."""
    import gc

    default = _first_threshold_in_a_fresh_process(None)
    assert default.returncode == 0, default.stderr
    set_to, gen0, gen1, gen2 = map(int, default.stdout.split())
    assert set_to == gen0 == 20_000
    assert (gen1, gen2) == gc.get_threshold()[1:]
    cpython_own = _first_threshold_in_a_fresh_process("700")
    assert cpython_own.returncode == 0 and cpython_own.stdout.split()[:2] == ["700", "700"], cpython_own.stderr


def test_a_first_threshold_that_is_not_a_positive_number_is_refused_by_name():
    """0 would turn automatic collection off altogether: refused, like a word."""
    for wrong in ("0", "-5", "lots"):
        out = _first_threshold_in_a_fresh_process(wrong)
        assert out.returncode != 0
        assert f"GDN_GC_GEN0 must be a positive number of objects, got {wrong!r}" in out.stderr


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
