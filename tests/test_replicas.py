"""Many replicas: placement by free capacity, sticky routing, live migration that loses nothing."""
from __future__ import annotations

import threading

import pytest
import torch

from gdn_client import ReplicaSet, ResourceExhaustedError
from servers import start_server
from util import random_inputs, write_gates

LAYERS, H, HV = 2, 2, 4


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    path = tmp_path_factory.mktemp("replicas") / "gates.safetensors"
    write_gates(path, LAYERS, HV, seed=12)
    return str(path)


def _flags(weights: str, sessions: int) -> tuple[str, ...]:
    return ("--layers", str(LAYERS), "--q-heads", str(H), "--v-heads", str(HV), "--weights", weights,
            "--max-sessions", str(sessions))


def _steps(seed: int, n: int) -> list[tuple[int, dict]]:
    gen = torch.Generator().manual_seed(seed)
    return [(i % LAYERS, {k: v[0] for k, v in random_inputs(1, 1 + i % 3, H, HV, gen=gen).items()}) for i in range(n)]


def test_sessions_spread_by_free_capacity_and_stick_to_their_home(weights):
    with start_server(*_flags(weights, 3)) as r0, start_server(*_flags(weights, 5)) as r1:
        with ReplicaSet([r0.address, r1.address]) as replicas:
            sessions = [replicas.create_session() for _ in range(8)]
            homes = [replicas.home_of(s) for s in sessions]
            assert homes.count(r0.address) == 3 and homes.count(r1.address) == 5  # filled to capacity, most free first
            assert replicas.free_capacity() == {r0.address: 0, r1.address: 0}
            with pytest.raises(ResourceExhaustedError):
                replicas.create_session()
            for s in sessions:  # each call goes to the home replica (the other one does not know the id)
                layer, x = _steps(1, 1)[0]
                s.decode(layer, **x)
                s.close()


def test_live_migration_under_load_loses_nothing(weights):
    """Four sessions decode on two replicas from four threads; one of them moves from replica 0
    to replica 1 halfway through its run. Every output equals that of an uninterrupted run."""
    n_steps, moved_at = 16, 8
    plans = {c: _steps(100 + c, n_steps) for c in range(4)}
    with start_server(*_flags(weights, 8)) as solo:  # the uninterrupted reference, one session at a time
        with ReplicaSet([solo.address]) as replicas:
            expected = {}
            for c, plan in plans.items():
                with replicas.session() as s:
                    expected[c] = [s.decode(layer, **x) for layer, x in plan]

    with start_server(*_flags(weights, 8)) as r0, start_server(*_flags(weights, 8)) as r1:
        with ReplicaSet([r0.address, r1.address]) as replicas:
            sessions = {c: replicas.create_session() for c in plans}
            mover = next(c for c, s in sessions.items() if replicas.home_of(s) == r0.address)
            outputs: dict[int, list[torch.Tensor]] = {c: [] for c in plans}
            errors: list[BaseException] = []

            def run(c: int) -> None:
                try:
                    for i, (layer, x) in enumerate(plans[c]):
                        if c == mover and i == moved_at:
                            replicas.migrate(sessions[c], r1.address)
                        outputs[c].append(sessions[c].decode(layer, **x))
                except BaseException as e:  # surfaced below
                    errors.append(e)

            threads = [threading.Thread(target=run, args=(c,)) for c in plans]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=120)
            assert not errors, errors[0]
            assert replicas.home_of(sessions[mover]) == r1.address
            for c in plans:
                assert len(outputs[c]) == n_steps
                for i, (got, want) in enumerate(zip(outputs[c], expected[c])):
                    assert torch.equal(got, want), f"session {c} step {i} differs (moved: {c == mover})"
            # the old copy is gone from replica 0
            assert sum(1 for s in sessions.values() if replicas.home_of(s) == r0.address) == replicas.clients[
                r0.address
            ].model_info().sessions_in_use


def test_new_sessions_avoid_a_draining_replica(weights):
    """During --shutdown-delay-s a replica still serves its sessions but reports NOT_SERVING:
    new sessions go elsewhere, and the old ones can still be migrated off it."""
    import signal
    import time

    with start_server(*_flags(weights, 8), "--shutdown-delay-s", "5") as r0, start_server(*_flags(weights, 2)) as r1:
        with ReplicaSet([r0.address, r1.address]) as replicas:
            s = replicas.create_session()
            assert replicas.home_of(s) == r0.address  # the most free slots
            r0.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 10
            while r0.address in replicas.free_capacity() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert list(replicas.free_capacity()) == [r1.address]
            assert replicas.home_of(replicas.create_session()) == r1.address
            layer, x = _steps(3, 1)[0]
            s.decode(layer, **x)  # still served while draining
            replicas.migrate(s, r1.address)
            assert replicas.home_of(s) == r1.address
