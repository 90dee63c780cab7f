"""Durable sessions (`--state-dir DIR`): a snapshot written on shutdown, restored on start.

On SIGTERM, once every request in flight has finished and the scheduler has stopped, the server
writes every live session here; on the next start it loads them back before it accepts requests,
so clients continue with the same session ids and get the same outputs they would have got.

Layout of DIR:

    manifest.json            the commit point, written last (temporary file, fsync, rename, fsync DIR)
    snapshot-<generation>/   one safetensors file per session: 000000.safetensors, 000001...
    rejected-<UTC time>/     a snapshot refused at start (checksum, other model shape), moved aside
                             for an operator to inspect; never loaded again

A snapshot-<generation>/ without a manifest is a write that never finished (the process was
killed while writing, or the disk failed): the next start says so with an ERROR line, since the
sessions it was writing are lost, and removes it.

manifest.json (UTF-8 JSON):

    {"format": "gdn-serve-snapshot", "version": 1, "generation": "<hex>", "created": "<UTC ISO>",
     "model": {"num_layers": L, "num_q_heads": H, "num_v_heads": HV, "head_dim_k": K,
               "head_dim_v": V, "state_dtype": "bfloat16" | "float32", "scale": s, "gates_sha256": "<hex>"},
     "sessions": [{"id": "<session id>", "owner": null | "<identity>",
                   "file": "snapshot-<generation>/000000.safetensors",
                   "bytes": <file size>, "sha256": "<hex of the whole file>"}, ...],
     "checksum": "<sha256 hex of the canonical JSON (sorted keys, compact) of all other keys>"}

A session file (safetensors, little-endian):

    state          bf16 or fp32 (the manifest's state_dtype)  [L, HV, V, K]  the recurrent state, as
                   `Backend.read_session` returns it
    positions      int64 [L]            tokens taken per layer
    last_out.{l}   bf16  [T, HV, V]     this session's output of its last step at layer l
    metadata       {"session_id": id, "last_steps": JSON {"<l>": [count_before, T, digest, speculative], ...}}

(digest: this session's inputs of that step as first sent, so a retry with others is refused.)

The last steps make a request whose reply was lost in the shutdown safe to retry after the
restart: it is answered again, not applied twice (docs/protocol.md, section 6).

Restore checks everything before it touches the pool: the manifest checksum, the model shape,
capacity, and every session file's size, sha256 and tensor shapes. A snapshot that fails any check
is refused as a whole, with one ERROR log line saying why, and moved aside: the server then starts
with no sessions, never with some of them. A snapshot written for other gate parameters or another
query scale is loaded with a WARNING (outputs will differ from the old server's). One written with
the other --state-dtype is loaded converted to this server's, with a WARNING: the operator chose
the dtype on this command line (bfloat16 -> float32 is exact; float32 -> bfloat16 rounds every
state once).

A restored snapshot is consumed (manifest removed, then its files): if the server later dies
without a clean shutdown, the old states are not loaded again under ids that have moved on.
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
import logging
import os
import secrets
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from gdn_server.config import STATE_DTYPE_BYTES, ModelShape
from gdn_server.lifecycle import drop_speculation
from gdn_server.placement import Shard
from gdn_server.sessions import LastStep, Session, StepRecord
from gdn_server.limits import MAX_SESSION_ID_LEN
from gdn_server.weights import GateParams

if TYPE_CHECKING:
    from gdn_server.backends import Backend

log = logging.getLogger(__name__)

FORMAT = "gdn-serve-snapshot"
VERSION = 1
MANIFEST = "manifest.json"



class SnapshotError(RuntimeError):
    """A snapshot that cannot be written, or one refused at start."""


# -- small file helpers ----------------------------------------------------------------------------


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durable(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _sha256_hex(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def _canonical(obj: dict) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def _gates_sha256(gates: GateParams) -> str:
    h = hashlib.sha256()
    for t in (gates.A_log, gates.dt_bias):
        h.update(t.detach().cpu().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def _model_entry(shape: ModelShape, backend: "Backend", gates: GateParams) -> dict:
    return {
        "num_layers": shape.num_layers,
        "num_q_heads": shape.num_q_heads,
        "num_v_heads": shape.num_v_heads,
        "head_dim_k": shape.head_dim_k,
        "head_dim_v": shape.head_dim_v,
        "state_dtype": shape.state_dtype,
        "scale": float(backend.scale),
        "gates_sha256": _gates_sha256(gates),
    }


# -- one session <-> one safetensors file ----------------------------------------------------------


def encode_session(session: Session, state: torch.Tensor, shape: ModelShape) -> bytes:
    """The safetensors bytes of one session (see the module docstring)."""
    tensors = {
        "state": state.contiguous(),
        "positions": torch.tensor(session.positions, dtype=torch.int64),
    }
    steps = {}
    HV, V = shape.num_v_heads, shape.head_dim_v
    for layer, last in sorted(session.last_steps.items()):
        if last.out is None:  # never finished (a failed step): nothing to answer a retry with
            continue
        row_bytes = len(last.out) // last.rows
        row = last.out[last.row * row_bytes : (last.row + 1) * row_bytes]
        tensors[f"last_out.{layer}"] = torch.frombuffer(bytearray(row), dtype=torch.bfloat16).reshape(
            last.tokens, HV, V
        )
        steps[str(layer)] = [last.count_before, last.tokens, last.digest, last.record.speculative]
    metadata = {"session_id": session.id, "last_steps": json.dumps(steps)}
    return st_save(tensors, metadata=metadata)


@dataclass
class _Restored:
    id: str
    owner: str | None
    state: torch.Tensor  # [L, HV, V, K] in the snapshot's state dtype
    positions: list[int]
    last_steps: dict[int, LastStep]


def decode_session(data: bytes, entry: dict, shape: ModelShape, state_dtype: str | None = None) -> _Restored:
    """Parses and checks one session file whose sha256 already matched; raises SnapshotError.
    `state_dtype` is the snapshot's (its manifest's), by default the shape's."""
    name = entry["file"]
    try:
        tensors = st_load(data)
        meta = _safetensors_metadata(data)
        steps = json.loads(meta.get("last_steps", "{}"))
    except Exception as e:  # safetensors raises its own error types
        raise SnapshotError(f"{name}: not a readable safetensors file ({e})") from None
    L, HV, V, K = shape.num_layers, shape.num_v_heads, shape.head_dim_v, shape.head_dim_k
    if meta.get("session_id") != entry["id"]:
        raise SnapshotError(f"{name}: holds session {meta.get('session_id')!r}, the manifest says {entry['id']!r}")
    state, positions = tensors.get("state"), tensors.get("positions")
    dtype = state_dtype or shape.state_dtype
    if state is None or state.dtype != getattr(torch, dtype) or tuple(state.shape) != (L, HV, V, K):
        raise SnapshotError(f"{name}: state must be {dtype} {[L, HV, V, K]}")
    if positions is None or positions.dtype != torch.int64 or tuple(positions.shape) != (L,):
        raise SnapshotError(f"{name}: positions must be int64 [{L}]")
    pos = [int(p) for p in positions]
    if any(p < 0 for p in pos):
        raise SnapshotError(f"{name}: negative positions")
    last_steps = {}
    for key, step in steps.items():
        # [count_before, T, digest of this session's inputs, speculative]: a retry must match the
        # digest and the flag; a file without the flag holds a plain step
        count_before, tokens, digest, speculative = (list(step) + [None, False])[:4]
        layer = int(key)
        out = tensors.get(f"last_out.{layer}")
        if not 0 <= layer < L or out is None or out.dtype != torch.bfloat16 or tuple(out.shape) != (tokens, HV, V):
            raise SnapshotError(f"{name}: last step of layer {key} is malformed")
        if count_before + tokens != pos[layer]:
            raise SnapshotError(f"{name}: last step of layer {layer} does not end at its position")
        out_bytes = out.contiguous().view(torch.int16).numpy().tobytes()
        last_steps[layer] = LastStep(int(count_before), StepRecord(int(tokens), 1, bool(speculative), out_bytes), 0, digest)
    return _Restored(entry["id"], entry.get("owner"), state.contiguous(), pos, last_steps)


def _safetensors_metadata(data: bytes) -> dict[str, str]:
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    return header.get("__metadata__", {}) or {}


# -- writing ---------------------------------------------------------------------------------------


def save_snapshot(state_dir: str | os.PathLike, shards: Sequence[Shard], gates: GateParams) -> bool:
    """Writes every live session to `state_dir` atomically; returns whether every one was saved.

    Call only with no step in flight (the scheduler stopped). One session that cannot be
    encoded is logged and left out, and the others are saved; a directory that cannot be
    written saves none (an ERROR line either way)."""
    root = Path(state_dir)
    backend = shards[0].backend
    shape = backend.shape
    started = time.monotonic()
    every = [(shard, session) for shard in shards for session in shard.sessions.sessions()]
    try:
        root.mkdir(parents=True, exist_ok=True)
        generation = f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{secrets.token_hex(4)}"
        gen_dir = root / f"snapshot-{generation}"
        gen_dir.mkdir()
        entries = []
        total = 0
        skipped = []
        for n, (shard, session) in enumerate(every):
            try:
                drop_speculation(shard.sessions, shard.backend, session)  # committed states only, rings folded
                data = encode_session(session, shard.backend.read_session(session.slot), shape)
            except Exception:
                log.exception("session %r cannot be saved: left out of the snapshot", session.id)
                skipped.append(session.id)
                continue
            rel = f"{gen_dir.name}/{n:06d}.safetensors"
            _write_durable(root / rel, data)
            entries.append(
                {"id": session.id, "owner": session.owner, "file": rel, "bytes": len(data), "sha256": _sha256_hex(data)}
            )
            total += len(data)
        _fsync_dir(gen_dir)
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "generation": generation,
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(),
            "model": _model_entry(shape, backend, gates),
            "sessions": entries,
        }
        manifest["checksum"] = _sha256_hex(_canonical(manifest))
        tmp = root / (MANIFEST + ".tmp")
        _write_durable(tmp, json.dumps(manifest, indent=1).encode())
        os.replace(tmp, root / MANIFEST)
        _fsync_dir(root)
    except OSError as e:
        log.error("cannot write the session snapshot to %s: %s; %d session(s) lost", root, e, len(every))
        return False
    for old in root.glob("snapshot-*"):  # superseded generations, or leftovers of a crashed write
        if old.name != gen_dir.name:
            shutil.rmtree(old, ignore_errors=True)
    log.info(
        "wrote %d session(s) to %s (%.1f MiB, %.2f s)",
        len(entries), root / MANIFEST, total / 2**20, time.monotonic() - started,
    )
    if skipped:
        log.error("%d session(s) could not be saved and are lost: %s", len(skipped), ", ".join(map(repr, skipped)))
    return not skipped


# -- restoring -------------------------------------------------------------------------------------


def _read_manifest(root: Path, shape: ModelShape, free: int) -> dict:
    try:
        manifest = json.loads((root / MANIFEST).read_bytes())
    except (OSError, ValueError) as e:
        raise SnapshotError(f"{MANIFEST} is unreadable: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise SnapshotError(f"{MANIFEST} is not a {FORMAT} manifest")
    checksum = manifest.pop("checksum", None)
    if checksum != _sha256_hex(_canonical(manifest)):
        raise SnapshotError(f"{MANIFEST} fails its checksum (corrupt or edited)")
    if manifest.get("version") != VERSION:
        raise SnapshotError(f"{MANIFEST} has version {manifest.get('version')}, this server reads {VERSION}")
    model = manifest["model"]
    want = {k: getattr(shape, k) for k in ("num_layers", "num_q_heads", "num_v_heads", "head_dim_k", "head_dim_v")}
    got = {k: model.get(k) for k in want}
    if got != want:
        raise SnapshotError(f"snapshot is for model {got}, this server serves {want}")
    if model.get("state_dtype") not in STATE_DTYPE_BYTES:
        raise SnapshotError(f"snapshot has state dtype {model.get('state_dtype')!r}, not one of {list(STATE_DTYPE_BYTES)}")
    entries = manifest["sessions"]
    if len(entries) > free:
        raise SnapshotError(f"snapshot has {len(entries)} sessions, this server has room for {free} (--max-sessions)")
    ids = [e["id"] for e in entries]
    if len(set(ids)) != len(ids) or not all(isinstance(i, str) and 0 < len(i) <= MAX_SESSION_ID_LEN for i in ids):
        raise SnapshotError("snapshot has duplicate or malformed session ids")
    gen_prefix = f"snapshot-{manifest['generation']}/"
    for e in entries:
        if not isinstance(e["file"], str) or not e["file"].startswith(gen_prefix) or ".." in e["file"]:
            raise SnapshotError(f"snapshot names a file outside its generation: {e['file']!r}")
    return manifest


def _read_session_file(root: Path, entry: dict, shape: ModelShape, state_dtype: str) -> _Restored:
    path = root / entry["file"]
    try:
        data = path.read_bytes()
    except OSError as e:
        raise SnapshotError(f"{entry['file']}: {e}") from None
    if len(data) != entry["bytes"]:
        raise SnapshotError(f"{entry['file']}: {len(data)} bytes, the manifest says {entry['bytes']} (truncated?)")
    if _sha256_hex(data) != entry["sha256"]:
        raise SnapshotError(f"{entry['file']}: fails its sha256 checksum (corrupt)")
    return decode_session(data, entry, shape, state_dtype)


def _load_verified(root: Path, shards: Sequence[Shard], gates: GateParams) -> int:
    backend = shards[0].backend
    shape = backend.shape
    try:
        manifest = _read_manifest(root, shape, sum(shard.free for shard in shards))
        entries = manifest["sessions"]
        saved_dtype = manifest["model"]["state_dtype"]
        for entry in entries:  # pass 1: check every file before touching the pool
            _read_session_file(root, entry, shape, saved_dtype)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise SnapshotError(f"malformed manifest or session file: {e!r}") from None
    model = manifest["model"]
    if model.get("gates_sha256") != _gates_sha256(gates) or model.get("scale") != float(backend.scale):
        log.warning(
            "the session snapshot in %s was written with other gate parameters (--weights/--seed) or "
            "another --scale: sessions are restored, but their outputs will differ from the old server's",
            root,
        )
    if saved_dtype != shape.state_dtype:
        log.warning(
            "the session snapshot in %s holds %s states and this server holds %s (--state-dtype): its %d "
            "session(s) are converted to %s as they are restored", root, saved_dtype, shape.state_dtype, len(entries),
            shape.state_dtype,
        )
    created: list[tuple[Shard, Session]] = []
    try:  # pass 2: load (files are checked again, in case they changed since pass 1)
        for entry in entries:
            r = _read_session_file(root, entry, shape, saved_dtype)
            shard = max(shards, key=lambda s: (s.free, -s.index))  # spread over the devices
            session = shard.sessions.create(owner=r.owner, session_id=r.id, restoring=True)
            created.append((shard, session))
            shard.backend.write_session(session.slot, r.state.to(shard.backend.pool_dtype))
            session.positions = r.positions
            session.last_steps = r.last_steps
            session.last_used = time.monotonic()
    except BaseException:
        for shard, session in created:  # never half-loaded
            shard.sessions.remove(session.id)
            shard.backend.reset_session(session.slot)
            shard.sessions.free_slot(session.slot)
        raise
    return len(entries)


def _move_aside(root: Path, manifest_path: Path) -> Path:
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    dest = root / f"rejected-{stamp}-{secrets.token_hex(2)}"
    dest.mkdir()
    for gen in root.glob("snapshot-*"):
        os.replace(gen, dest / gen.name)
    os.replace(manifest_path, dest / MANIFEST)
    _fsync_dir(root)
    return dest


def _consume(root: Path) -> None:
    (root / MANIFEST).unlink()
    _fsync_dir(root)
    for gen in root.glob("snapshot-*"):
        shutil.rmtree(gen, ignore_errors=True)


def load_snapshot(state_dir: str | os.PathLike, shards: Sequence[Shard], gates: GateParams) -> int:
    """Restores the sessions saved in `state_dir`, if any; returns how many.

    Call before the server accepts requests. A snapshot that fails a check is refused whole
    (ERROR log line, moved aside, 0 sessions restored); the server still starts. A state dir
    that cannot be written raises SnapshotError now, rather than losing the sessions at shutdown.
    """
    root = Path(state_dir)
    manifest_path = root / MANIFEST
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / ".write-test"
        _write_durable(probe, b"")
        probe.unlink()
    except OSError as e:
        raise SnapshotError(f"--state-dir {root} is not a writable directory: {e}") from e
    if not manifest_path.exists():
        unfinished = sorted(root.glob("snapshot-*"))
        if unfinished:
            log.error(
                "the last session snapshot in %s was never finished (%s has no manifest: the server was killed "
                "or its disk failed while writing it); its sessions are lost: starting with no sessions",
                root, unfinished[-1].name,
            )
            for leftover in unfinished:
                shutil.rmtree(leftover, ignore_errors=True)
        else:
            log.info("no session snapshot in %s: starting with no sessions", root)
        return 0
    started = time.monotonic()
    try:
        count = _load_verified(root, shards, gates)
    except SnapshotError as e:
        try:
            where = f"moved to {_move_aside(root, manifest_path)}"
        except OSError as move_error:
            where = f"could not be moved aside ({move_error})"
        log.error("refusing the session snapshot in %s: %s; it was %s; starting with no sessions", root, e, where)
        return 0
    try:
        _consume(root)
    except OSError as e:  # the next clean shutdown replaces it anyway
        log.warning("could not remove the restored snapshot from %s: %s", root, e)
    log.info("restored %d session(s) from %s (%.2f s)", count, manifest_path, time.monotonic() - started)
    return count
