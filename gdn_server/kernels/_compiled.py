"""Compiled kernels, kept in memory for the process and on disk between processes.

`cached_compile(cache, key, build)` is how every kernel here is compiled: `build()` runs the
CuTe DSL compile (seconds each; a CUDA server compiles some twenty variants as it starts), and
its result is kept in `cache` for the process. Where `use_disk_cache(folder)` named a folder (the
server does: `gdn-server --kernel-cache`, by default `config.default_kernel_cache()`), the
compiled object code is also written there, and a later process with the same kernels loads it
in milliseconds instead of compiling: a restarted server, every process of `--processes K` after
the first start, every test server.

What a file holds is the DSL's own export of the compiled function (`export_to_c`: host code and
the cubin), loaded back by the DSL's `cutlass.runtime.load_module`, the same object code the
compile itself would run. A file is named by a digest of everything that shapes that code: the
key (shape, state dtype, tiling), the source of this package, the DSL and tvm-ffi versions and
the target GPU architecture; any change names other files, and the least recently used are
removed once the folder holds more than MAX_FILES. Loading object code is running it, so the
folder must belong to the server's user and be writable by no one else (it is created so, mode
0700); a folder that is not is not used (a warning says why) and every kernel is compiled.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
import stat
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger(__name__)

MAX_FILES = 256  # compiled kernels kept in the folder: some twenty a model shape and state dtype
_SUFFIX = ".o"

_lock = threading.Lock()
_folder: Path | None = None
_digest: str | None = None  # of the package's source, the versions and the target (once a process)


def use_disk_cache(folder: str | os.PathLike | None) -> Path | None:
    """Keeps compiled kernels in `folder` from now on (created, mode 0700, where missing); None or
    "" keeps them in memory only. Returns the folder used: None as well where it cannot be created
    or another user could write to it (logged)."""
    global _folder
    if not folder:  # None or "": in memory only
        _folder = None
        return None
    path = Path(folder).expanduser()
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = path.stat()
    except OSError as e:
        log.warning("kernel cache %s unusable (%s): every kernel is compiled", path, e)
        _folder = None
        return None
    if info.st_uid != os.getuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        log.warning("kernel cache %s is not used: it must belong to this user and be writable by no one else "
                    "(loading a kernel from it runs its code); every kernel is compiled", path)
        _folder = None
        return None
    _folder = path
    return path


def disk_cache_folder() -> Path | None:
    """The folder compiled kernels are kept in (`use_disk_cache`), None where none is."""
    return _folder


def cached_compile(cache: dict, key: Any, build: Callable[[], Any]) -> Any:
    """The compiled kernel of `key`: from `cache`, else loaded from the disk cache, else compiled
    by `build()` (a DSL compile with tvm-ffi, whose export goes to the disk cache). Returns the
    bare tvm-ffi function (positional arguments; the DSL's keyword wrapper costs microseconds a
    call). Built once per key, under a lock: compiles take seconds and threads may race."""
    fn = cache.get(key)
    if fn is not None:
        return fn
    with _lock:
        fn = cache.get(key)
        if fn is None:
            fn = cache[key] = _load_or_build(key, build)
    return fn


def _load_or_build(key: Any, build: Callable[[], Any]) -> Any:
    folder = _folder
    if folder is None:
        return build().__tvm_ffi_object__()
    name = "gdn_" + hashlib.sha256(f"{_source_digest()}|{key!r}".encode()).hexdigest()[:32]
    path = folder / (name + _SUFFIX)
    if path.exists():
        try:
            from cutlass.runtime import load_module

            fn = getattr(load_module(str(path), enable_tvm_ffi=True), name)
        except Exception as e:  # a truncated or foreign file: compile again, and replace it
            log.warning("could not load the compiled kernel %s (%s): compiling it again", path, e)
        else:
            try:
                os.utime(path)  # used now: the pruning removes the least recently used
            except OSError:
                pass
            return fn
    compiled = build()
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=_SUFFIX)
        os.close(fd)
        try:
            compiled.export_to_c(tmp, function_name=name)
            os.replace(tmp, path)  # whole or not at all, for processes compiling the same kernel at once
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        _prune(folder)
    except Exception as e:  # a full or read-only disk: this process runs on, the next compiles again
        log.warning("could not keep the compiled kernel in %s: %s", folder, e)
    return compiled.__tvm_ffi_object__()


def _source_digest() -> str:
    """What, besides its key, shapes a kernel's compiled code: this package's source, the DSL's
    and tvm-ffi's versions, the Python version and the target architecture."""
    global _digest
    if _digest is None:
        h = hashlib.sha256()
        here = Path(__file__).parent
        for source in sorted(here.glob("*.py")):
            h.update(source.name.encode() + b"\0" + source.read_bytes() + b"\0")
        for dist in ("nvidia-cutlass-dsl", "apache-tvm-ffi"):
            try:
                h.update(f"{dist}={importlib.metadata.version(dist)}\0".encode())
            except importlib.metadata.PackageNotFoundError:
                h.update(f"{dist}=?\0".encode())
        h.update(f"python={sys.version_info[:2]}\0arch={_target_arch()}".encode())
        _digest = h.hexdigest()
    return _digest


def _target_arch() -> str:
    """The architecture the DSL compiles for, named as the DSL names it: CUTE_DSL_ARCH where set
    (a machine without a GPU), else the current GPU's, with the "a" the DSL adds from Hopper on
    (an H200 is sm_90a). So kernels compiled without a GPU for CUTE_DSL_ARCH=sm_90a, as an image's
    build does (`gdn-server --compile-kernels`), are the files a Hopper GPU's server loads."""
    arch = os.environ.get("CUTE_DSL_ARCH")
    if arch:
        return arch
    try:
        import torch

        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            return f"sm_{major}{minor}{'a' if major >= 9 else ''}"
    except Exception:  # no usable torch.cuda: the name says so
        pass
    return "unknown"


def _prune(folder: Path) -> None:
    """Removes the oldest compiled kernels beyond MAX_FILES (those of other versions, mostly), and
    what a process that died while writing one left (an hour on)."""
    stale = time.time() - 3600
    for tmp in folder.glob(".tmp-*" + _SUFFIX):
        try:
            if tmp.stat().st_mtime < stale:
                tmp.unlink()
        except OSError:  # finished or removed meanwhile
            pass
    files = []
    for path in folder.glob("gdn_*" + _SUFFIX):
        try:
            files.append((path.stat().st_mtime, path))
        except OSError:  # removed meanwhile by another process
            pass
    files.sort()
    for _, old in files[:max(0, len(files) - MAX_FILES)]:
        try:
            old.unlink()
        except OSError:
            pass
