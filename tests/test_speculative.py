"""Speculative steps and Commit over the history ring: rollback to the accepted prefix.

A draft's outputs are bit-for-bit those of its prefix sent as a plain step; a session that drafts
T tokens and commits n holds, once its ring is folded (ExportState folds first), the positions of
a twin session that was sent only the first n tokens as a plain step, and a state within the
rounding of the twin's (the ring defers the state's bf16 rounding to the fold, where plain steps
round after every step).
"""
from __future__ import annotations

import random
import signal

import grpc
import pytest
import torch

from gdn_client import Client, GdnError
from gdn_client.proto.gdn.v1 import gdn_pb2, gdn_pb2_grpc
from gdn_client.wire import tensor_from_proto
from reference import ReferenceModel, rel_err
from servers import start_server
from util import decode_request, random_inputs, write_gates

LAYERS, H, HV = 3, 2, 4
TIMEOUT = 30


@pytest.fixture(scope="module")
def gates(tmp_path_factory):
    path = tmp_path_factory.mktemp("spec") / "gates.safetensors"
    A_log, dt_bias = write_gates(path, LAYERS, HV, seed=8)
    return path, A_log, dt_bias


@pytest.fixture(scope="module")
def server(gates):
    with start_server("--layers", str(LAYERS), "--q-heads", str(H), "--v-heads", str(HV), "--weights", str(gates[0]),
                      "--max-sessions", "48") as srv:
        yield srv


@pytest.fixture()
def stub(server):
    with grpc.insecure_channel(server.address) as channel:
        yield gdn_pb2_grpc.GdnDecodeStub(channel)


def _create(stub, n):
    return [stub.CreateSession(gdn_pb2.CreateSessionRequest(), timeout=TIMEOUT).session_id for _ in range(n)]


def _export(stub, sid):
    chunks = list(stub.ExportState(gdn_pb2.ExportStateRequest(session_id=sid), timeout=TIMEOUT))
    return list(chunks[0].header.positions), b"".join(c.data for c in chunks[1:])


def _slice(x, rows):
    return {k: v[rows] for k, v in x.items()}


def _prefix(x, n):
    return {k: v[:, :n] for k, v in x.items()}


def _state(stub, sid):
    """(positions, the exported state as float32 [L, HV, V, K])."""
    positions, data = _export(stub, sid)
    return positions, torch.frombuffer(bytearray(data), dtype=torch.bfloat16).float().view(LAYERS, HV, 128, 128)


def _same_state(stub, a, b, tol=5e-3):
    """Same positions, and states within the bf16 rounding of each other."""
    (pa, sa), (pb, sb) = _state(stub, a), _state(stub, b)
    assert pa == pb
    assert rel_err(sa, sb) < tol


def _spec(req: gdn_pb2.DecodeRequest) -> gdn_pb2.DecodeRequest:
    req.speculative = True
    return req


@pytest.mark.parametrize("T", [3, 6])
def test_commit_n_equals_a_plain_step_of_the_first_n_tokens(stub, T):
    """For n = 0..T: drafts of several sessions batched together (and with plain steps of other
    sessions), committed to n, leave every layer exactly as the first n tokens alone would."""
    gen = torch.Generator().manual_seed(T)
    ns = list(range(T + 1))
    drafters, twins, bystanders = _create(stub, len(ns)), _create(stub, len(ns)), _create(stub, 2)
    # a common history first, so the drafts start from a non-zero state
    for layer in range(LAYERS):  # drafter i and twin i see the same inputs
        x = random_inputs(len(ns), 2, H, HV, gen=gen)
        stub.Decode(decode_request(layer, drafters + twins, {k: torch.cat([v, v]) for k, v in x.items()}), timeout=TIMEOUT)
    drafts = {}
    requests = []
    for layer in range(LAYERS):
        x = random_inputs(len(ns), T, H, HV, gen=gen)
        drafts[layer] = x
        requests.append(_spec(decode_request(layer, drafters, x, request_id=f"spec{layer}")))
        if T <= 4:  # plain steps of other sessions with the same T, pipelined into the same launches
            requests.append(decode_request(layer, bystanders, random_inputs(2, T, H, HV, gen=gen), request_id=f"plain{layer}"))
    replies = list(stub.DecodeStream(iter(requests), timeout=TIMEOUT))
    assert all(r.error_code == 0 for r in replies), [r.error_message for r in replies]
    spec_out = {int(r.request_id[4:]): tensor_from_proto(r.o) for r in replies if r.request_id.startswith("spec")}
    for i, n in enumerate(ns):
        reply = stub.Commit(gdn_pb2.CommitRequest(session_id=drafters[i], accepted=n), timeout=TIMEOUT)
        assert list(reply.positions) == [2 + n] * LAYERS
        assert sorted(reply.committed_layers) == list(range(LAYERS))
        if n:
            for layer in range(LAYERS):
                # plain steps stop at T = 4: a longer prefix is a fully accepted draft of n tokens
                prefix = decode_request(layer, [twins[i]], _prefix(_slice(drafts[layer], [i]), n))
                twin_out = tensor_from_proto(stub.Decode(_spec(prefix) if n > 4 else prefix, timeout=TIMEOUT).o)
                # the draft's outputs for its first n tokens are those of the prefix step
                assert torch.equal(spec_out[layer][i : i + 1, :n], twin_out)
            if n > 4:
                stub.Commit(gdn_pb2.CommitRequest(session_id=twins[i], accepted=n), timeout=TIMEOUT)
        _same_state(stub, drafters[i], twins[i])


def test_draft_outputs_match_the_reference(stub, gates):
    _, A_log, dt_bias = gates
    ref = ReferenceModel(A_log, dt_bias)
    gen = torch.Generator().manual_seed(4)
    (sid,) = _create(stub, 1)
    for T in (8, 5, 1):
        x = random_inputs(1, T, H, HV, gen=gen)
        out = tensor_from_proto(stub.Decode(_spec(decode_request(0, [sid], x)), timeout=TIMEOUT).o)
        assert rel_err(out, ref.step(0, [sid], **x)) < 5e-3
        stub.Commit(gdn_pb2.CommitRequest(session_id=sid, accepted=T), timeout=TIMEOUT)


def test_a_next_step_commits_all_tokens_and_retries_still_work(stub):
    gen = torch.Generator().manual_seed(5)
    a, b = _create(stub, 2)
    draft = random_inputs(1, 3, H, HV, gen=gen)
    first = stub.Decode(_spec(decode_request(1, [a], draft, positions=[0])), timeout=TIMEOUT)
    again = stub.Decode(_spec(decode_request(1, [a], draft, positions=[0])), timeout=TIMEOUT)  # lost reply: retry
    assert first.o.data == again.o.data and list(again.positions) == [3]
    stub.Decode(decode_request(1, [b], draft, positions=[0]), timeout=TIMEOUT)
    nxt = random_inputs(1, 2, H, HV, gen=gen)
    # a plain step at the same layer implies commit of all 3 draft tokens
    out_a = stub.Decode(decode_request(1, [a], nxt, positions=[3]), timeout=TIMEOUT)
    out_b = stub.Decode(decode_request(1, [b], nxt, positions=[3]), timeout=TIMEOUT)
    # the same numbers but for rounding: b's state was rounded to bf16 after its step, a's draft
    # entries are folded into its state unrounded by this step
    assert rel_err(tensor_from_proto(out_a.o), tensor_from_proto(out_b.o)) < 5e-3 and list(out_a.positions) == [5]
    # nothing is left to commit: Commit answers the positions and changes nothing
    reply = stub.Commit(gdn_pb2.CommitRequest(session_id=a, accepted=0), timeout=TIMEOUT)
    assert list(reply.positions) == [0, 5, 0] and list(reply.committed_layers) == []
    _same_state(stub, a, b)


def test_a_retry_must_repeat_the_speculative_flag(stub):
    """A step resent with the other speculative flag is not a retry: FAILED_PRECONDITION, and
    nothing is applied (no draft opened, no draft settled)."""
    gen = torch.Generator().manual_seed(11)
    plain, draft = _create(stub, 2)
    x = random_inputs(1, 2, H, HV, gen=gen)
    stub.Decode(decode_request(0, [plain], x, positions=[0]), timeout=TIMEOUT)
    stub.Decode(_spec(decode_request(0, [draft], x, positions=[0])), timeout=TIMEOUT)
    for sid, resend in ((plain, _spec(decode_request(0, [plain], x, positions=[0]))),
                        (draft, decode_request(0, [draft], x, positions=[0]))):
        with pytest.raises(grpc.RpcError) as info:
            stub.Decode(resend, timeout=TIMEOUT)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert list(stub.Commit(gdn_pb2.CommitRequest(session_id=plain, accepted=0), timeout=TIMEOUT).committed_layers) == []
    reply = stub.Commit(gdn_pb2.CommitRequest(session_id=draft, accepted=1), timeout=TIMEOUT)
    assert list(reply.committed_layers) == [0] and list(reply.positions) == [1, 0, 0]


def test_speculative_errors_change_nothing(stub):
    gen = torch.Generator().manual_seed(6)
    (a,) = _create(stub, 1)
    stub.Decode(_spec(decode_request(2, [a], random_inputs(1, 4, H, HV, gen=gen))), timeout=TIMEOUT)
    with pytest.raises(grpc.RpcError) as info:
        stub.Commit(gdn_pb2.CommitRequest(session_id=a, accepted=5), timeout=TIMEOUT)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    for rpc, req in ((stub.ForkSession, gdn_pb2.ForkSessionRequest(session_id=a)),
                     (lambda r, timeout: list(stub.ExportState(r, timeout=timeout)), gdn_pb2.ExportStateRequest(session_id=a))):
        with pytest.raises(grpc.RpcError) as info:
            rpc(req, timeout=TIMEOUT)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "Commit" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:  # plain steps keep the T <= 4 limit
        stub.Decode(decode_request(0, [a], random_inputs(1, 5, H, HV, gen=gen)), timeout=TIMEOUT)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as info:
        stub.Commit(gdn_pb2.CommitRequest(session_id="nope", accepted=0), timeout=TIMEOUT)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    reply = stub.Commit(gdn_pb2.CommitRequest(session_id=a, accepted=2), timeout=TIMEOUT)
    assert list(reply.positions) == [0, 0, 2]


def test_every_session_may_hold_a_draft_at_every_layer_at_once():
    """Every session has its own rings: all of them hold a draft at every layer at once."""
    gen = torch.Generator().manual_seed(7)
    with start_server("--layers", "2", "--q-heads", "1", "--v-heads", "2", "--head-dim", "32",
                      "--max-sessions", "40") as srv, grpc.insecure_channel(srv.address) as channel:
        stub = gdn_pb2_grpc.GdnDecodeStub(channel)
        sids = _create(stub, 40)
        for layer in range(2):
            x = random_inputs(len(sids), 8, 1, 2, K=32, gen=gen)
            stub.Decode(_spec(decode_request(layer, sids, x)), timeout=TIMEOUT)
        for sid in sids:
            reply = stub.Commit(gdn_pb2.CommitRequest(session_id=sid, accepted=8), timeout=TIMEOUT)
            assert list(reply.positions) == [8, 8]


def test_fork_and_export_after_commit_see_the_committed_tokens(stub):
    """Refused while a draft is open; after Commit, the fork and the export hold the state of the
    accepted tokens (the ring folded first), and the fork goes on as its source does."""
    gen = torch.Generator().manual_seed(12)
    a, twin = _create(stub, 2)
    x = random_inputs(1, 6, H, HV, gen=gen)
    stub.Decode(_spec(decode_request(0, [a], x)), timeout=TIMEOUT)
    with pytest.raises(grpc.RpcError) as info:
        stub.ForkSession(gdn_pb2.ForkSessionRequest(session_id=a), timeout=TIMEOUT)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    stub.Commit(gdn_pb2.CommitRequest(session_id=a, accepted=4), timeout=TIMEOUT)
    stub.Decode(decode_request(0, [twin], _prefix(x, 4)), timeout=TIMEOUT)
    child = stub.ForkSession(gdn_pb2.ForkSessionRequest(session_id=a), timeout=TIMEOUT).session_id
    _same_state(stub, a, twin)
    assert _export(stub, child) == _export(stub, a)
    nxt = random_inputs(1, 3, H, HV, gen=gen)
    outs = [stub.Decode(decode_request(0, [s], nxt), timeout=TIMEOUT).o.data for s in (a, child)]
    assert outs[0] == outs[1]


def test_a_ring_that_overflows_many_times_stays_with_plain_steps():
    """400 drafts of 1..8 tokens with random accepts at one layer (the 16-entry ring folds every
    few drafts), against a twin sent the accepted tokens as plain steps: outputs and the state
    stay within the bf16 rounding of each other (the twin rounds its state after every step, the
    drafter only at its folds)."""
    pick = random.Random(3)
    gen = torch.Generator().manual_seed(3)
    with start_server("--layers", "1", "--q-heads", "1", "--v-heads", "2", "--head-dim", "32") as srv, \
            grpc.insecure_channel(srv.address) as channel:
        stub = gdn_pb2_grpc.GdnDecodeStub(channel)
        drafter, twin = _create(stub, 2)
        worst = 0.0
        for _ in range(400):
            T = pick.randint(1, 8)
            x = random_inputs(1, T, 1, 2, K=32, gen=gen)
            spec = tensor_from_proto(stub.Decode(_spec(decode_request(0, [drafter], x)), timeout=TIMEOUT).o)
            n = pick.randint(0, T)
            stub.Commit(gdn_pb2.CommitRequest(session_id=drafter, accepted=n), timeout=TIMEOUT)
            for first in range(0, n, 4):  # plain steps take up to 4 tokens
                part = {k: v[:, first : min(n, first + 4)] for k, v in x.items()}
                plain = tensor_from_proto(stub.Decode(decode_request(0, [twin], part), timeout=TIMEOUT).o)
                worst = max(worst, rel_err(spec[:, first : min(n, first + 4)], plain))
        assert worst < 2e-2
        (pd, sd), (pt, st) = (_export(stub, s) for s in (drafter, twin))
        assert pd == pt
        sd, st = (torch.frombuffer(bytearray(d), dtype=torch.bfloat16).float() for d in (sd, st))
        assert rel_err(sd, st) < 2e-2


def test_client_speculate_draft_and_verify_loop(server, gates):
    """The documented loop: draft T tokens through every layer, keep n, repeat."""
    _, A_log, dt_bias = gates
    ref = ReferenceModel(A_log, dt_bias)
    gen = torch.Generator().manual_seed(9)
    with Client(server.address) as client, client.session() as s:
        for round_, (T, n) in enumerate([(4, 2), (3, 3), (6, 0), (2, 1)]):
            drafts = [random_inputs(1, T, H, HV, gen=gen) for _ in range(LAYERS)]
            with s.speculate() as spec:
                outs = [spec.decode(layer, *(x[name][0] for name in "qkvab")) for layer, x in enumerate(drafts)]
                positions = spec.commit(n)
            for layer, x in enumerate(drafts):  # the reference sees only the accepted prefix
                if n:
                    expected = ref.step(layer, [s.id], **_prefix(x, n))
                    assert rel_err(outs[layer][:n], expected[0]) < 5e-3
            assert all(p == positions[0] for p in positions.values())
        with pytest.raises(GdnError):
            with s.speculate() as spec:
                spec.decode(0, *(random_inputs(1, 2, H, HV, gen=gen)[name][0] for name in "qkvab"))
                raise GdnError("verification failed", grpc.StatusCode.ABORTED)
        # leaving the block by an exception committed 0 tokens: layer 0 is where it was
        assert s.positions[0] == positions[0]


def test_shutdown_between_step_and_commit_never_leaves_a_half_committed_session(tmp_path, gates):
    """SIGTERM with a draft open: the snapshot keeps the committed state; after the restart the
    client re-sends the draft and commits, ending exactly where an uninterrupted run ends."""
    gen = torch.Generator().manual_seed(10)
    base = ("--layers", str(LAYERS), "--q-heads", str(H), "--v-heads", str(HV), "--weights", str(gates[0]),
            "--state-dir", str(tmp_path / "state"))
    before = random_inputs(1, 2, H, HV, gen=gen)
    drafts = [random_inputs(1, 4, H, HV, gen=gen) for _ in range(LAYERS)]
    with start_server(*base) as srv, grpc.insecure_channel(srv.address) as channel:
        stub = gdn_pb2_grpc.GdnDecodeStub(channel)
        sid, twin = _create(stub, 2)
        for layer in range(LAYERS):
            stub.Decode(decode_request(layer, [sid, twin], {k: v.expand(2, *v.shape[1:]).contiguous() for k, v in before.items()}), timeout=TIMEOUT)
            stub.Decode(_spec(decode_request(layer, [sid], drafts[layer], positions=[2])), timeout=TIMEOUT)
        assert srv.stop(signal.SIGTERM) == 0
    with start_server(*base) as srv, grpc.insecure_channel(srv.address) as channel:
        stub = gdn_pb2_grpc.GdnDecodeStub(channel)
        assert _export(stub, sid)[0] == [2] * LAYERS  # the open draft was not kept
        for layer in range(LAYERS):
            stub.Decode(_spec(decode_request(layer, [sid], drafts[layer], positions=[2])), timeout=TIMEOUT)
            stub.Decode(decode_request(layer, [twin], _prefix(drafts[layer], 3), positions=[2]), timeout=TIMEOUT)
        stub.Commit(gdn_pb2.CommitRequest(session_id=sid, accepted=3), timeout=TIMEOUT)
        _same_state(stub, sid, twin)


def test_a_snapshot_keeps_committed_ring_entries(tmp_path, gates):
    """SIGTERM with committed entries in the rings (and a draft open at one layer): the snapshot
    folds them into the state it saves and drops the draft; after the restart the session goes on
    as a twin that took the same tokens as plain steps."""
    gen = torch.Generator().manual_seed(13)
    base = ("--layers", str(LAYERS), "--q-heads", str(H), "--v-heads", str(HV), "--weights", str(gates[0]),
            "--state-dir", str(tmp_path / "state"))
    drafts = [random_inputs(1, 5, H, HV, gen=gen) for _ in range(LAYERS)]
    with start_server(*base) as srv, grpc.insecure_channel(srv.address) as channel:
        stub = gdn_pb2_grpc.GdnDecodeStub(channel)
        sid, twin = _create(stub, 2)
        for layer in range(LAYERS):
            stub.Decode(_spec(decode_request(layer, [sid], drafts[layer])), timeout=TIMEOUT)
            stub.Decode(decode_request(layer, [twin], _prefix(drafts[layer], 2)), timeout=TIMEOUT)
        stub.Commit(gdn_pb2.CommitRequest(session_id=sid, accepted=2), timeout=TIMEOUT)
        stub.Decode(_spec(decode_request(0, [sid], random_inputs(1, 3, H, HV, gen=gen))), timeout=TIMEOUT)
        assert srv.stop(signal.SIGTERM) == 0
    with start_server(*base) as srv, grpc.insecure_channel(srv.address) as channel:
        stub = gdn_pb2_grpc.GdnDecodeStub(channel)
        _same_state(stub, sid, twin)
        nxt = random_inputs(1, 2, H, HV, gen=gen)
        outs = [tensor_from_proto(stub.Decode(decode_request(1, [s], nxt), timeout=TIMEOUT).o) for s in (sid, twin)]
        assert rel_err(outs[0], outs[1]) < 5e-3
