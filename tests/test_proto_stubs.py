"""The committed Python stubs are exactly what `make proto` generates from proto/gdn/v1/gdn.proto."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
GENERATED = ["gdn_pb2.py", "gdn_pb2.pyi", "gdn_pb2_grpc.py"]


def test_committed_stubs_match_the_proto(tmp_path):
    pytest.importorskip("grpc_tools")
    # same command as the Makefile's `proto` target, writing into a scratch tree
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-Igdn_client/proto=proto", f"--python_out={tmp_path}",
         f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}", "proto/gdn/v1/gdn.proto"],
        cwd=REPO, check=True, capture_output=True, timeout=120,
    )
    for name in GENERATED:
        fresh = (tmp_path / "gdn_client/proto/gdn/v1" / name).read_text()
        committed = (REPO / "gdn_client/proto/gdn/v1" / name).read_text()
        assert fresh == committed, f"gdn_client/proto/gdn/v1/{name} is stale: run `make proto` and commit"
