"""The compiled kernels kept on disk between processes (gdn_server.kernels._compiled), with no GPU
(CUTE_DSL_ARCH=sm_90a): a second process loads what the first compiled, without compiling; what it
loads checks its arguments as the compiled function does; a file that does not load is compiled
again and replaced; a folder another user could write to is not used; the oldest files go."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
import time

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from gdn_server.kernels import _compiled  # noqa: E402

# One process's use of the folder: the decode kernel of T = 1 and the segment copy, then what each
# says of arguments it cannot take (CPU tensors, too few); with forbid_compile, any DSL compile fails.
CHILD = textwrap.dedent("""
    import json, sys, torch
    folder, forbid_compile = sys.argv[1], sys.argv[2] == "1"
    if forbid_compile:
        import cutlass.cute as cute
        def refuse(*args, **kwargs):
            raise AssertionError("compiled although the folder holds this kernel")
        cute.compile = refuse
    from gdn_server.kernels import _compiled, compile_variant, compiled_segments
    assert _compiled.use_disk_cache(folder) is not None
    decode, copy = compile_variant(1, 16, 32), compiled_segments(False)
    bf = torch.bfloat16
    args = (torch.zeros(4, 32, 128, 128, dtype=bf), *[torch.zeros(2, dtype=torch.int32)] * 3,
            *[torch.zeros(2, 1, 16, 128, dtype=bf)] * 2, torch.zeros(2, 1, 32, 128, dtype=bf),
            *[torch.zeros(2, 1, 32, dtype=bf)] * 2, *[torch.zeros(2, 32)] * 2,
            torch.zeros(2, 1, 32, 128, dtype=bf), 1.0, 1.0, 20.0)
    said = []
    for fn, call in ((decode, args), (decode, args[:3]), (copy, args[:2])):
        try:
            fn(*call)
            said.append("ran")
        except Exception as e:
            said.append(f"{type(e).__name__}: {e}")
    print(json.dumps({"types": [type(decode).__name__, type(copy).__name__], "said": said}))
""")


def _child(folder, forbid_compile: bool) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, str(folder), "1" if forbid_compile else "0"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_second_process_loads_the_kernels_the_first_compiled(tmp_path):
    folder = tmp_path / "kernels"
    first = _child(folder, forbid_compile=False)
    files = sorted(folder.iterdir())
    assert len(files) == 2 and all(f.suffix == ".o" for f in files)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
    second = _child(folder, forbid_compile=True)
    # the same bare tvm-ffi functions, refusing the same arguments with the same words
    assert second == first
    assert first["types"] == ["Function", "Function"]
    assert "Mismatched Tensor on argument #0" in first["said"][0] and "Expects 15 parameters" in first["said"][1]
    assert sorted(folder.iterdir()) == files


def test_a_file_that_does_not_load_is_compiled_again_and_replaced(tmp_path):
    folder = tmp_path / "kernels"
    _child(folder, forbid_compile=False)
    broken = sorted(folder.iterdir())[0]
    broken.write_bytes(b"not an object file")
    _child(folder, forbid_compile=False)
    assert broken.read_bytes()[:4] == b"\x7fELF"
    _child(folder, forbid_compile=True)


def test_a_folder_others_can_write_to_is_not_used(tmp_path, caplog):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o700)
    shared.chmod(0o770)
    try:
        assert _compiled.use_disk_cache(shared) is None
        assert "writable by no one else" in caplog.text
        mine = tmp_path / "a" / "b"
        assert _compiled.use_disk_cache(mine) == mine and stat.S_IMODE(mine.stat().st_mode) == 0o700
    finally:
        _compiled.use_disk_cache(None)


def test_the_target_architecture_names_other_files(monkeypatch):
    monkeypatch.setattr(_compiled, "_digest", None)
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    hopper = _compiled._source_digest()
    monkeypatch.setattr(_compiled, "_digest", None)
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_100a")
    assert _compiled._source_digest() != hopper


def test_the_least_recently_used_files_go_past_the_bound_and_dead_writes_go(tmp_path, monkeypatch):
    monkeypatch.setattr(_compiled, "MAX_FILES", 4)
    for i in range(6):
        path = tmp_path / f"gdn_{i}.o"
        path.write_bytes(b"x")
        os.utime(path, (1000 + i, 1000 + i))
    (tmp_path / "other.txt").write_text("not ours")
    for name, age in ((".tmp-dead.o", 7200), (".tmp-writing.o", 10)):  # a dead writer's, a live one's
        (tmp_path / name).write_bytes(b"x")
        os.utime(tmp_path / name, (time.time() - age, time.time() - age))
    _compiled._prune(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".tmp-writing.o", "gdn_2.o", "gdn_3.o", "gdn_4.o", "gdn_5.o", "other.txt"]


@pytest.mark.parametrize("value", ["", None])
def test_the_server_flag_off_compiles_at_every_start(value, tmp_path):
    """`--kernel-cache ''` (or no folder): nothing is written, each kernel compiled in memory."""
    _compiled.use_disk_cache(value)
    assert _compiled._folder is None


def test_a_gpu_is_named_as_the_dsl_names_it(monkeypatch):
    """Without CUTE_DSL_ARCH the files are named for the GPU's architecture as the DSL compiles for
    it (sm_90a on Hopper), so kernels compiled without a GPU for sm_90a are a Hopper server's."""
    import torch

    monkeypatch.delenv("CUTE_DSL_ARCH", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for capability, name in (((9, 0), "sm_90a"), ((10, 0), "sm_100a"), ((8, 0), "sm_80")):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, c=capability: c)
        assert _compiled._target_arch() == name


def test_compile_kernels_fills_the_folder_and_a_second_run_finds_them(tmp_path):
    """`gdn-server --compile-kernels` (what an image's build runs) compiles every kernel a CUDA server
    of the shape launches, for sm_90a where no GPU and no CUTE_DSL_ARCH say otherwise; run again it
    compiles none; a shape the kernels do not cover, or no folder, is an error."""
    folder = tmp_path / "kernels"
    env = {k: v for k, v in os.environ.items() if k != "CUTE_DSL_ARCH"}
    env["CUDA_VISIBLE_DEVICES"] = ""

    def run(*flags: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "gdn_server", "--layers", "1", "--q-heads", "16", "--v-heads",
                               "32", "--compile-kernels", *flags], capture_output=True, text=True, timeout=300, env=env)

    first = run("--kernel-cache", str(folder))
    assert first.returncode == 0, first.stderr[-3000:]
    files = {f.name: f.stat().st_ino for f in folder.iterdir()}
    count = len(files)
    assert count >= 17 and all(name.startswith("gdn_") and name.endswith(".o") for name in files)
    said = f"{count} kernels for sm_90a in {folder}: {count} compiled, 0 there already ("
    assert first.stdout.startswith(said), first.stdout
    second = run("--kernel-cache", str(folder))
    assert second.returncode == 0 and f": 0 compiled, {count} there already" in second.stdout
    assert {f.name: f.stat().st_ino for f in folder.iterdir()} == files  # loaded, not written again
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o700)
    shared.chmod(0o770)
    for flags, said in ((("--kernel-cache", ""), "give it a folder"),
                        (("--kernel-cache", str(shared)), "no kernels can be kept in"),
                        (("--kernel-cache", str(folder), "--head-dim", "64"), "head dims K = V = 128")):
        refused = run(*flags)
        assert refused.returncode == 2 and said in refused.stderr
