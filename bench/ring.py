"""Check and time the history-ring kernels (speculative verify and fold) on one GPU, in one go.

    python bench/ring.py                   # checks, then the timing table
    python bench/ring.py --skip-checks     # the timing table only
    python bench/ring.py --state-dtype float32   # the same over an fp32 state pool
    python bench/ring.py --skip-checks --verify-width narrow   # every verify CTA over one q/k head

Checks (against tests/reference.py in float64): sequences of verifies with random accepts over
batches whose rows sit at different ring fills, so that one launch holds rows that fold and rows
that do not; every output and every folded state within 2e-3 relative error of a float64 model
that rounds the state to the pool's dtype (--state-dtype, bf16 by default) where the kernel does (at a fold); padding rows zero; pool rows no
batch row names left bit-for-bit untouched (state and ring); the fold kernel (`ring_fold`) on the
rings left at the end; H:HV = 16:32, 8:32, 32:32; T = 1..8; a CUDA-graph replay equals an eager
launch; drafts with random accepts beside plain steps of the accepted tokens over `--drift-steps`
steps, both against one float64 state never rounded (issue 48: the drafts drift no more).

Timings: qwen3-next heads (H=16, HV=32, K=V=128), a 4096-row pool of --state-dtype with its rings, 16
disjoint row sets rotated so the state is cold in L2, device time by CUDA-graph replay
(triton.testing.do_bench_cudagraph, median). Per (B, T):
- verify: no row folds, the ring holding P entries (P drawn from the fills a verify meets);
- step, full accepts: rows at the fills of a steady state where every token is accepted, so a
  fraction T/16 of the rows fold in each launch (the fold every 16/T steps, amortized within one
  launch as a serving batch of sessions at different fills has it); an accept costs no launch;
- step, random accepts: fills of a steady state with 1..T accepted tokens, uniform;
- every row folds; the fold kernel alone (every row a full ring);
- our plain T-token step (`gdn_decode`, the states written in place): where "step, full accepts"
  is faster, a launch of plain steps runs through the ring instead (gdn_server/planner.py);
- a plain read: the verify's rows' states read by a kernel that does nothing else
  (bench/state_copy.py), the plainest kernel that reads what a verify must.
FlashInfer's ring verify (T = 4, 8) is timed on the verify's rows, fills, tokens and pool when
its module (flashinfer.gdn_kernels.gdn_decode_bf16_wy_ucache) imports on the host, over a ring of
its own format; otherwise its figures are the ones measured on an H200 in issue 48
(REFERENCE_US), marked * in the table. Its fused verify-and-flush kernel
(gdn_decode_bf16_wy_ucache_flush, a 32-slot ring whose cursor the caller commits) is timed the
way "step, full accepts" is, where it imports: rows at the fills of its own steady state with
every token accepted (a fraction T/16 flush in each launch), the cursors left as they are.

Writes bench/out/ring-<UTC time>.json (or under --out) with the date, commit and command, and
prints the tables last.
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import random
import time
import traceback

import common  # first: it puts this checkout on sys.path
import torch

REPO = common.REPO


ref = common.reference()
from state_copy import state_copy_us  # noqa: E402
from gdn_server.kernels._ring_api import RING, folded_base, new_ring, ring_fold, ring_verify, wide_qk_heads  # noqa: E402

DEV = "cuda"
STATE_DTYPE = torch.bfloat16  # the pool's dtype: --state-dtype
VERIFY_WIDTH = "auto"  # q/k heads per verify CTA: --verify-width
D = 128
TOL = 2e-3
# (B, T): FlashInfer's ring verify (ring holding P entries, its flush not counted), us on an H200, issue 48
REFERENCE_US = {(32, 4): 17.7, (32, 8): 18.6, (128, 4): 49.9, (128, 8): 52.5, (512, 4): 169.2, (512, 8): 178.3}
ROWS = [(32, 4), (32, 8), (128, 4), (128, 8), (512, 4), (512, 8)]


# ----------------------------------------------------------------------------- inputs and model
def reference_tokens(S, x, live):
    """float64 states after each token and the outputs, rows `live`: (outs [B, T, HV, V],
    states [T + 1] of [B, HV, V, K])."""
    lay = x["layers"][live].long()
    Al, dt = x["A_log"][lay], x["dt_bias"][lay]
    T = x["q"].shape[1]
    states, outs = [S], []
    for t in range(T):
        sl = slice(t, t + 1)
        o, S = ref.gdn_reference_step(S, *(x[n][live][:, sl] for n in ("q", "k", "v", "a", "b")), Al, dt,
                                      dtype=torch.float64)
        outs.append(o.to(DEV))
        states.append(S.to(DEV))
    return torch.cat(outs, 1), states


def state_name() -> str:
    """The pool's dtype by name, as the ring API takes it."""
    return str(STATE_DTYPE).removeprefix("torch.")


class RingRun:
    """B batch rows over a pool: the kernel's state, rings and fills, and a float64 model of
    every row's committed state (rounded to the pool's dtype, STATE_DTYPE, where the kernel folds)."""

    def __init__(self, B, H, HV, gen, pad_every=0, spare=8):
        self.B, self.H, self.HV, self.gen = B, H, HV, gen
        N = 2 * B + spare
        self.pool = (torch.randn(N, HV, D, D, device=DEV, generator=gen) * 0.5).to(STATE_DTYPE)
        self.ring = new_ring(N, H, HV, state_dtype=state_name())
        for r in self.ring:  # stale entries past the fill must never matter: poison them
            r.copy_(torch.randn(r.shape, device=DEV, generator=gen).to(r.dtype) * 100)
        self.rows = torch.randperm(N, device=DEV, generator=gen)[:B].to(torch.int32)
        if pad_every:
            self.rows[::pad_every] = -1
        self.live = self.rows >= 0
        lr = self.rows[self.live].long()
        self.hist = [0] * B
        self.model = self.pool[lr].double()
        self.errs = dict(out=0.0, state=0.0, folds=0, launches=0)
        self.ok = True

    def step(self, T, accepts=None, log=None):
        B, live = self.B, self.live
        x = ref.kernel_inputs(B, T, self.H, self.HV, 3, self.gen, device=DEV)
        li = [i for i in range(B) if self.rows[i] >= 0]
        folds = [folded_base(self.hist[i], T) == 0 and self.hist[i] > 0 for i in li]
        fold_t = torch.tensor(folds, device=DEV, dtype=torch.bool)
        pre_round = self.model.clone()
        if any(folds):
            self.model[fold_t] = self.model[fold_t].to(STATE_DTYPE).double()
        out = torch.full((B, T, self.HV, D), float("nan"), device=DEV, dtype=torch.bfloat16)
        hist = torch.tensor(self.hist, device=DEV, dtype=torch.int32)
        before_pool, before_ring = self.pool.clone(), [r.clone() for r in self.ring]
        ring_verify(self.pool, self.rows, hist, x["layers"], x["q"], x["k"], x["v"], x["a"], x["b"], x["A_log"],
                    x["dt_bias"], *self.ring, out)
        torch.cuda.synchronize()
        o_ref, states = reference_tokens(self.model, x, live)
        e_out = ref.rel_err(out[live].float(), o_ref)
        self.errs["out"] = max(self.errs["out"], e_out)
        lr = self.rows[live].long()
        if any(folds):
            e_state = ref.rel_err(self.pool[lr][fold_t].float(), pre_round[fold_t])
            self.errs["state"] = max(self.errs["state"], e_state)
            self.errs["folds"] += sum(folds)
        pad_zero = bool((out[~live] == 0).all()) if (~live).any() else True
        named = torch.zeros(self.pool.shape[0], dtype=torch.bool, device=DEV)
        named[lr] = True
        untouched = torch.equal(self.pool[~named].view(torch.int16), before_pool[~named].view(torch.int16))
        untouched &= all(torch.equal(r[~named].view(torch.int16) if r.dtype != torch.float32 else r[~named],
                                     b[~named].view(torch.int16) if b.dtype != torch.float32 else b[~named])
                         for r, b in zip(self.ring, before_ring))
        no_fold_same = True
        if not all(folds):  # rows that did not fold keep their checkpoint bit-for-bit
            keep = lr[~fold_t]
            no_fold_same = torch.equal(self.pool[keep].view(torch.int16), before_pool[keep].view(torch.int16))
        finite = bool(torch.isfinite(out[live].float()).all())
        ok = e_out < TOL and pad_zero and untouched and no_fold_same and finite
        if any(folds):
            ok &= self.errs["state"] < TOL
        self.ok &= ok
        self.errs["launches"] += 1
        if log and not ok:
            log(f"  FAIL step T={T}: err_out={e_out:.2e} state={self.errs['state']:.2e} pad0={pad_zero} "
                f"untouched={untouched} nofold_same={no_fold_same} finite={finite} hist={self.hist[:8]}")
        # accept: each live row keeps 1..T tokens
        for n, i in enumerate(li):
            a = accepts[i] if accepts is not None else random.randint(1, T)
            base = folded_base(self.hist[i], T)
            self.hist[i] = base + a
            self.model[n] = states[a][n]
        return ok

    def fold(self):
        """ring_fold on every row; the pool then equals the model (before its rounding to the pool's dtype)."""
        hist = torch.tensor(self.hist, device=DEV, dtype=torch.int32)
        ring_fold(self.pool, self.rows, hist, *self.ring)
        torch.cuda.synchronize()
        lr = self.rows[self.live].long()
        e = ref.rel_err(self.pool[lr].float(), self.model)
        self.model = self.pool[lr].double()
        self.hist = [0] * self.B
        return e


def check_sequences(gen, log, check_t=tuple(range(1, 9)), other_heads=((8, 32), (32, 32))):
    """Qwen3-Next's heads at every T in `check_t` (B = 1, 7, 64 at T = 1, 2, 4, 8; B = 5 else),
    the other head ratios at T = 2, 4, 8 (those in `check_t`)."""
    rows = []
    cases = [(B, T, 16, 32) for T in check_t for B in ((1, 7, 64) if T in (1, 2, 4, 8) else (5,))]
    cases += [(9, T, H, HV) for T in (2, 4, 8) if T in check_t for H, HV in other_heads]
    for B, T, H, HV in cases:
        try:
            run = RingRun(B, H, HV, gen, pad_every=3 if B > 2 else 0)
            steps = 2 * RING // T + 3  # at least two folds per row
            for _ in range(steps):
                run.step(T, log=log)
            e_fold = run.fold()
            ok = run.ok and e_fold < TOL
            r = dict(B=B, T=T, H=H, HV=HV, steps=steps, err_out=run.errs["out"], err_state=run.errs["state"],
                     folds=run.errs["folds"], err_fold_kernel=e_fold, ok=ok)
        except Exception as e:  # noqa: BLE001 - reported, the run goes on
            traceback.print_exc()
            r = dict(B=B, T=T, H=H, HV=HV, error=repr(e), ok=False)
        log(f"check {json.dumps(r)}")
        rows.append(r)
    return rows


def check_graph(gen, log):
    """A captured verify replays to the eager result (a mix of folding and plain rows)."""
    B, T, H, HV = 16, 4, 16, 32
    run = RingRun(B, H, HV, gen)
    # the fills below commit entries that RingRun poisons (they would overflow to inf and NaN,
    # which no equality holds): keys, small corrections and falling log-decays, as a verify writes
    run.ring[0].copy_(torch.randn(run.ring[0].shape, device=DEV, generator=gen).to(torch.bfloat16))
    run.ring[1].copy_((torch.randn(run.ring[1].shape, device=DEV, generator=gen) * 0.1).to(run.ring[1].dtype))
    run.ring[2].copy_(-torch.rand(run.ring[2].shape, device=DEV, generator=gen).cumsum(-1))
    hist = torch.tensor([[0, 5, 12, 16][i % 4] for i in range(B)], device=DEV, dtype=torch.int32)
    x = ref.kernel_inputs(B, T, H, HV, 3, gen, device=DEV)
    pool0, ring0 = run.pool.clone(), [r.clone() for r in run.ring]
    args = lambda pool, ring, out: (pool, run.rows, hist, x["layers"], x["q"], x["k"], x["v"], x["a"], x["b"],  # noqa: E731
                                    x["A_log"], x["dt_bias"], *ring, out)
    out_e = torch.empty(B, T, HV, D, device=DEV, dtype=torch.bfloat16)
    ring_verify(*args(run.pool, run.ring, out_e))
    pool_e, ring_e = run.pool.clone(), [r.clone() for r in run.ring]
    pool_g, ring_g = pool0.clone(), [r.clone() for r in ring0]
    out_g = torch.zeros_like(out_e)
    ring_verify(*args(pool0.clone(), [r.clone() for r in ring0], out_g))  # warm up
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(graph):
        ring_verify(*args(pool_g, ring_g, out_g))
    torch.cuda.current_stream().wait_stream(s)
    pool_g.copy_(pool0)
    for r, r0 in zip(ring_g, ring0):
        r.copy_(r0)
    out_g.zero_()
    graph.replay()
    torch.cuda.synchronize()
    def bits(t):
        return t.view(torch.int32) if t.element_size() == 4 else t.view(torch.int16)

    finite = bool(torch.isfinite(out_e.float()).all())
    ok = finite and all(torch.equal(bits(a), bits(b)) for a, b in zip((out_g, pool_g, *ring_g), (out_e, pool_e, *ring_e)))
    log(f"graph: replay == eager: {ok}")
    return dict(ok=bool(ok))


def check_drift(steps, gen, log, B=32, H=16, HV=32, T=4):
    """Issue 48's drift check: B sessions take `steps` drafts of T tokens, each followed by an
    accept of 1..T of them (one count per step, drawn at random), through the ring; beside them
    the same sessions take only the accepted tokens as plain steps (`gdn_decode` of T = accepted,
    states written in place). Both start from zero states on the pool's dtype with the server's
    gate distribution (long memories) and are held against one float64 state never rounded:
    each path's worst output error over the accepted tokens and its state's error at the end
    (the ring's entries folded into a copy first)."""
    from gdn_server.config import ModelShape
    from gdn_server.kernels import gdn_decode
    from gdn_server.weights import random_gate_params

    gates = random_gate_params(ModelShape(1, H, HV), 4321)
    x0 = dict(A_log=gates.A_log.to(DEV), dt_bias=gates.dt_bias.to(DEV),  # [1, HV]
              layers=torch.zeros(B, device=DEV, dtype=torch.int32))
    rows = torch.arange(B, device=DEV, dtype=torch.int32)
    pools = {path: torch.zeros(B, HV, D, D, device=DEV, dtype=STATE_DTYPE) for path in ("ring", "plain")}
    ring = new_ring(B, H, HV, state_dtype=state_name())
    S = torch.zeros(B, HV, D, D, device=DEV, dtype=torch.float64)
    rnd = random.Random(5)
    P, worst, accepted = 0, dict(ring=0.0, plain=0.0), 0
    t0 = time.time()
    for _ in range(steps):
        x = dict(x0, **{n: (torch.randn(B, T, HV if n == "v" else H, D, device=DEV, generator=gen) if n in "qkv"
                            else torch.randn(B, T, HV, device=DEV, generator=gen)).to(torch.bfloat16) for n in "qkvab"})
        a = rnd.randint(1, T)
        out = torch.empty(B, T, HV, D, device=DEV, dtype=torch.bfloat16)
        ring_verify(pools["ring"], rows, torch.full((B,), P, device=DEV, dtype=torch.int32), x["layers"], x["q"],
                    x["k"], x["v"], x["a"], x["b"], x["A_log"], x["dt_bias"], *ring, out)
        P = folded_base(P, T) + a
        taken = dict(x, **{n: x[n][:, :a].contiguous() for n in "qkvab"})
        plain_out = torch.empty(B, a, HV, D, device=DEV, dtype=torch.bfloat16)
        gdn_decode(pools["plain"], rows, x["layers"], *(taken[n] for n in "qkvab"), x["A_log"], x["dt_bias"], plain_out)
        o_ref = torch.stack([ref.token_all_heads(S, *(taken[n][:, t] for n in "qkvab"), x["A_log"], x["dt_bias"],
                                                 1.0 / math.sqrt(D)) for t in range(a)], 1)
        worst["ring"] = max(worst["ring"], ref.rel_err(out[:, :a].float(), o_ref))
        worst["plain"] = max(worst["plain"], ref.rel_err(plain_out.float(), o_ref))
        accepted += a
    folded = pools["ring"].clone()
    ring_fold(folded, rows, torch.full((B,), P, device=DEV, dtype=torch.int32), *ring)
    torch.cuda.synchronize()
    r = dict(steps=steps, B=B, T=T, tokens=accepted, state_dtype=state_name(),
             ring_out=worst["ring"], plain_out=worst["plain"],
             ring_state=ref.rel_err(folded.double(), S), plain_state=ref.rel_err(pools["plain"].double(), S),
             seconds=round(time.time() - t0, 1))
    r["ok"] = r["ring_state"] <= r["plain_state"] and r["ring_out"] <= r["plain_out"]
    log(f"drift {json.dumps(r)}")
    return r


# ----------------------------------------------------------------------------- timing
def steady_fills(T, full, n=20000, seed=1):
    """Ring fills P that verifies meet in a steady state: full accepts (every token kept) or 1..T
    accepted uniformly; returns a sample of n fills."""
    rnd = random.Random(seed)
    P, out = 0, []
    for i in range(n + 1000):
        if i >= 1000:
            out.append(P)
        P = folded_base(P, T) + (T if full else rnd.randint(1, T))
    return out


def fold_rate(fills, T):
    return sum(folded_base(p, T) == 0 and p > 0 for p in fills) / len(fills)


class Sets:
    """16 disjoint row sets of a pool, each with its tokens, fills and outputs; `call` cycles them
    (a CUDA graph captures a different set per captured call)."""

    def __init__(self, B, T, H, HV, N, fills, gen, sets=16):
        self.i, self.sets = 0, []
        # disjoint sets need sets * B pool rows: fewer sets at large B (8 of 512 rows are still
        # far more state than L2 holds)
        sets = min(sets, N // B)
        perm = torch.randperm(N, device=DEV, generator=gen)
        rnd = random.Random(B * 100 + T)
        for s in range(sets):
            rows = perm[s * B:(s + 1) * B].to(torch.int32).contiguous()
            x = ref.kernel_inputs(B, T, H, HV, 1, gen, device=DEV)
            hist = torch.tensor([rnd.choice(fills) for _ in range(B)], device=DEV, dtype=torch.int32)
            out = torch.empty(B, T, HV, D, device=DEV, dtype=torch.bfloat16)
            self.sets.append((rows, hist, x, out))

    def call(self, fn):
        def run():
            rows, hist, x, out = self.sets[self.i % len(self.sets)]
            self.i += 1
            fn(rows, hist, x, out)
        return run


def time_device(fn, rep_ms=200):
    import triton.testing as tt

    fn()
    torch.cuda.synchronize()
    return 1e3 * tt.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median")


def bench(rows, gen, log, N=4096):
    H, HV = 16, 32
    pool = (torch.randn(N, HV, D, D, device=DEV, generator=gen) * 0.5).to(STATE_DTYPE)
    ring = new_ring(N, H, HV, state_dtype=state_name())
    for r in ring:
        r.copy_(torch.randn(r.shape, device=DEV, generator=gen).to(r.dtype))
    ring[2].copy_(-torch.rand(ring[2].shape, device=DEV, generator=gen).cumsum(-1))  # G: falling, as log-decays sum
    try:
        from gdn_server.kernels import gdn_decode
    except Exception as e:  # noqa: BLE001
        gdn_decode = None
        log(f"plain step unavailable: {e!r}")
    bf16 = STATE_DTYPE == torch.bfloat16
    fi_verify = flashinfer_kernel("gdn_decode_bf16_wy_ucache", "gated_delta_rule_mtp_ucache", log) if bf16 else None
    fi_flush = flashinfer_kernel("gdn_decode_bf16_wy_ucache_flush", "gated_delta_rule_mtp_ucache_flush", log) if bf16 else None
    if fi_verify is not None:
        fi_ring = flashinfer_ring(N, H, HV, RING, gen)
    if fi_flush is not None:  # the flush kernel's ring has 32 slots, a window of at most 16
        fi_ring32 = flashinfer_ring(N, H, HV, 2 * RING, gen)

    def verify(rows_, hist, x, out):
        T = x["q"].shape[1]
        qk_heads = dict(auto=None, narrow=1, wide=wide_qk_heads(T, H, HV))[VERIFY_WIDTH]
        ring_verify(pool, rows_, hist, x["layers"], x["q"], x["k"], x["v"], x["a"], x["b"], x["A_log"], x["dt_bias"],
                    *ring, out, qk_heads=qk_heads)

    def fold_only(rows_, hist, x, out):
        ring_fold(pool, rows_, hist, *ring)

    def plain(rows_, hist, x, out):  # the plain step, states written in place
        gdn_decode(pool, rows_, x["layers"], x["q"], x["k"], x["v"], x["a"], x["b"], x["A_log"], x["dt_bias"], out)

    res = []
    for B, T in rows:
        full, rand = steady_fills(T, True), steady_fills(T, False)
        no_fold = [p for p in rand if folded_base(p, T) == p or p == 0]
        r = dict(B=B, T=T, fold_rate_full=fold_rate(full, T), fold_rate_random=fold_rate(rand, T))
        cases = dict(verify_us=(verify, no_fold), step_full_us=(verify, full), step_random_us=(verify, rand),
                     fold_all_us=(verify, [RING]), fold_only_us=(fold_only, [RING]))
        for name, (fn, fills) in cases.items():
            try:
                sets = Sets(B, T, H, HV, N, fills, gen)
                r[name] = time_device(sets.call(fn))
                if name == "verify_us":  # what reading these rows' states costs, nothing else
                    r["state_read_us"] = state_copy_us(pool, [s[0] for s in sets.sets], write=False)
                    if fi_verify is not None and T in FLASHINFER_T:  # the same rows, fills, tokens and pool
                        try:
                            r["flashinfer_us"] = time_device(sets.call(flashinfer_call(fi_verify, pool, fi_ring, sets)))
                        except Exception as e:  # noqa: BLE001
                            log(f"time FlashInfer B={B} T={T} failed: {e!r}")
            except Exception as e:  # noqa: BLE001
                r[name] = None
                log(f"time {name} B={B} T={T} failed: {e!r}")
        if fi_flush is not None and T in FLASHINFER_T:
            try:
                sets = Sets(B, T, H, HV, N, flashinfer_full_fills(T), gen)
                # its cursors left for the caller to commit, as a graph-captured server does, so
                # every replay meets the same fills
                base = torch.randint(0, 2 * RING, (B,), device=DEV, dtype=torch.int32, generator=gen)
                r["flashinfer_flush_us"] = time_device(sets.call(flashinfer_call(
                    fi_flush, pool, fi_ring32, sets, cache_base=base, restart_hist_on_flush=False)))
            except Exception as e:  # noqa: BLE001
                log(f"time FlashInfer's flush B={B} T={T} failed: {e!r}")
        if gdn_decode is not None:
            try:
                r["plain_us"] = time_device(Sets(B, T, H, HV, N, [0], gen).call(plain))
            except Exception as e:  # noqa: BLE001
                r["plain_us"] = None
                log(f"time plain B={B} T={T} failed: {e!r}")
        r["flashinfer_issue48_us"] = REFERENCE_US.get((B, T))
        state_mb = B * HV * D * D * pool.element_size() / 1e6
        r["state_read_GBs"] = state_mb / r["verify_us"] * 1e3 if r.get("verify_us") else None
        log(f"time {json.dumps(r)}")
        res.append(r)
    return res


FLASHINFER_T = (4, 8)  # the T its ring verify is built for


def flashinfer_kernel(module, name, log):
    """FlashInfer's `name` from flashinfer.gdn_kernels.`module` where it imports on this host, else
    None (its verify's column then shows issue 48's figures)."""
    try:
        return getattr(importlib.import_module(f"flashinfer.gdn_kernels.{module}"), name)
    except Exception as e:  # noqa: BLE001
        log(f"FlashInfer's {module}.{name} does not import here ({type(e).__name__}): not timed")
        return None


def flashinfer_ring(N, H, HV, slots, gen):
    """Random ring tensors in FlashInfer's format, `slots` entries a row: normalised keys, bf16
    corrections [slots, V], falling G."""
    return (torch.nn.functional.normalize(torch.randn(N, H, slots, D, device=DEV, generator=gen), dim=-1).to(torch.bfloat16),
            (torch.randn(N, HV, slots, D, device=DEV, generator=gen) * 0.1).to(torch.bfloat16),
            -torch.rand(N, HV, slots, device=DEV, generator=gen).cumsum(-1))


def flashinfer_full_fills(T):
    """The fills its flush kernel meets with every token accepted: a row flushes (and restarts its
    window with the T new entries) when P + T would pass 16, so P runs T, 2T, .., 16."""
    return list(range(T, RING + 1, T))


def flashinfer_call(fi_kernel, pool, fi_ring, sets, **extra):
    """FlashInfer's verify (or verify and flush, with its `extra` arguments) of a Sets entry (rows,
    hist, tokens, out) over `pool` and its own ring, with one (A_log, dt_bias) pair for every set
    (it caches their bf16 casts by tensor)."""
    x0 = sets.sets[0][2]
    A_log, dt_bias = x0["A_log"][0], x0["dt_bias"][0]

    def call(rows, hist, x, out):
        fi_kernel(A_log, x["a"], dt_bias, q=x["q"], k=x["k"], v=x["v"], b=x["b"], initial_state_source=pool,
                  initial_state_indices=rows, k_cache=fi_ring[0], u_cache=fi_ring[1], g_cache=fi_ring[2],
                  hist_len=hist, output=out, **extra)
    return call


def to_markdown(res):
    f = lambda x, s=".1f": "-" if x is None else format(x, s)  # noqa: E731
    lines = [f"# History-ring kernels on {res['device']} ({res['date']}), commit {res['commit']}", "",
             f"Device time per launch, CUDA-graph replay, median; H=16, HV=32, K=V=128, 4096-row {res['state_dtype']} pool, "
             f"verify CTA width {res.get('verify_width', 'auto')}, 16 rotated row sets. FlashInfer's ring verify: timed on the same rows, fills and tokens where it imports (T = 4, 8), "
             "else issue 48's H200 figure (marked *).", "",
             "Plain read: the verify's rows' states read and nothing else (bench/state_copy.py).", "",
             "| B | T | FlashInfer ring verify | ours verify | plain read | step, full accepts (folds) "
             "| step, random accepts (folds) | every row folds | fold kernel | plain T-step "
             "| full-accept step / FlashInfer | FlashInfer verify + flush, full accepts |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res.get("timings", ()):
        fi, st = r.get("flashinfer_us") or r.get("flashinfer_issue48_us"), r.get("step_full_us")
        ratio = f"{st / fi:.2f}" if fi and st else "-"
        mark = "" if r.get("flashinfer_us") or fi is None else "*"
        lines.append(f"| {r['B']} | {r['T']} | {f(fi)}{mark} | {f(r.get('verify_us'))} | {f(r.get('state_read_us'))} | "
                     f"{f(st)} ({r['fold_rate_full']:.0%}) | "
                     f"{f(r.get('step_random_us'))} ({r['fold_rate_random']:.0%}) | {f(r.get('fold_all_us'))} | "
                     f"{f(r.get('fold_only_us'))} | {f(r.get('plain_us'))} | {ratio} | {f(r.get('flashinfer_flush_us'))} |")
    if res.get("checks"):
        lines += ["", "## Correctness (worst relative error vs float64, over the sequence)", "",
                  "| B | T | H:HV | verifies | folds | out | folded state | fold kernel | ok |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for c in res["checks"]:
            if "error" in c:
                lines.append(f"| {c['B']} | {c['T']} | {c['H']}:{c['HV']} | - | - | - | - | - | {c['error'][:60]} |")
                continue
            lines.append(f"| {c['B']} | {c['T']} | {c['H']}:{c['HV']} | {c['steps']} | {c['folds']} | {c['err_out']:.2e} | "
                         f"{c['err_state']:.2e} | {c['err_fold_kernel']:.2e} | {c['ok']} |")
    for key in ("graph", "drift"):
        if res.get(key):
            lines.append(f"\n{key}: {json.dumps(res[key])}")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--skip-timings", action="store_true")
    ap.add_argument("--drift-steps", type=int, default=256)
    ap.add_argument("--check-t", default="1,2,3,4,5,6,7,8", help="T values of the sequence checks ('': none)")
    ap.add_argument("--rows", default=",".join(f"{b}:{t}" for b, t in ROWS), help="B:T pairs to time")
    ap.add_argument("--out", default=None, help="folder for the JSON (default bench/out)")
    ap.add_argument("--state-dtype", choices=("bfloat16", "float32"), default="bfloat16",
                    help="the state pool's dtype (each its own compiled kernel)")
    ap.add_argument("--verify-width", choices=("auto", "narrow", "wide"), default="auto",
                    help="q/k heads per verify CTA in the timings: by launch size as served (auto), one, or the widest")
    args = ap.parse_args()
    global STATE_DTYPE, VERIFY_WIDTH
    STATE_DTYPE = getattr(torch, args.state_dtype)
    VERIFY_WIDTH = args.verify_width
    random.seed(0)
    gen = torch.Generator(device=DEV).manual_seed(0)
    lines = []

    def log(msg):
        print(msg, flush=True)
        lines.append(msg)

    res = dict(device=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d"), commit=common.git_commit(),
               state_dtype=args.state_dtype, verify_width=args.verify_width)
    path = common.out_path("ring", args.out)
    if not args.skip_checks:
        res["checks"] = check_sequences(gen, log, tuple(int(t) for t in args.check_t.split(",") if t))
        for key, fn in (("graph", lambda: check_graph(gen, log)), ("drift", lambda: check_drift(args.drift_steps, gen, log))):
            try:
                res[key] = fn()
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                res[key] = dict(error=repr(e), ok=False)
        common.write_json(path, res)
    if not args.skip_timings:
        rows = [tuple(int(v) for v in p.split(":")) for p in args.rows.split(",")]
        res["timings"] = bench(rows, gen, log)
    common.write_json(path, dict(res, log=lines))
    print(to_markdown(res))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
