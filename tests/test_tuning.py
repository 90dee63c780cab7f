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
