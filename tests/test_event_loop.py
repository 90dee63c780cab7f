"""The event loop choice (gdn_server.event_loop): each choice runs coroutines, uvloop where asked
for, and a real server serves decode steps on the standard loop as it does on uvloop (the rest of
the suite runs on the default, `auto`)."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from gdn_client.proto.gdn.v1 import gdn_pb2, gdn_pb2_grpc
from gdn_server.event_loop import EVENT_LOOPS, loop_factory, loop_name, run
from servers import SMALL_MODEL, start_server
from util import decode_request, random_inputs

uvloop = pytest.importorskip("uvloop")


async def _loop_module() -> str:
    await asyncio.sleep(0)
    return type(asyncio.get_running_loop()).__module__.split(".")[0]


def test_each_choice_runs_on_its_loop():
    assert run(_loop_module(), "asyncio") == "asyncio"
    assert run(_loop_module(), "uvloop") == "uvloop"
    assert run(_loop_module(), "auto") == "uvloop" == loop_name("auto")  # installed here
    assert loop_factory("asyncio") is None
    with pytest.raises(ValueError, match="event loop must be one of"):
        loop_factory("trio")
    assert set(EVENT_LOOPS) == {"auto", "uvloop", "asyncio"}


@pytest.mark.parametrize("choice", ["asyncio", "uvloop"])
def test_a_server_serves_streams_on_either_loop(choice):
    with start_server(*SMALL_MODEL, "--event-loop", choice, "--log-level", "INFO") as s, \
            grpc.insecure_channel(s.address) as ch:
        stub = gdn_pb2_grpc.GdnDecodeStub(ch)
        sid = stub.CreateSession(gdn_pb2.CreateSessionRequest()).session_id
        reqs = [decode_request(layer, [sid], random_inputs(1, 1, 2, 4), positions=[0]) for layer in range(3)]
        replies = list(stub.DecodeStream(iter(reqs), timeout=60))
        assert [list(r.positions) for r in replies] == [[1]] * 3
        assert any(f"event loop: {choice}" in line for line in s.log), s.log[-5:]


def test_asking_for_uvloop_without_it_fails_at_once_with_a_reason():
    """`--event-loop uvloop` where uvloop cannot be imported: exit 2 and why, before any start-up;
    `auto` then runs on asyncio's loop."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['uvloop'] = None\n"  # makes `import uvloop` fail
        "from gdn_server.event_loop import loop_name\n"
        "assert loop_name('auto') == 'asyncio'\n"
        "from gdn_server.cli import main\n"
        "sys.exit(main(['--device', 'cpu', '--port', '0', '--layers', '1', '--q-heads', '1', '--v-heads', '1',"
        " '--event-loop', 'uvloop']))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert "uvloop is not installed" in out.stderr


@pytest.mark.parametrize("env, argv, expected", [
    ({}, [], "asyncio"), ({}, ["--uvloop"], "uvloop"), ({"GDN_ECHO_UVLOOP": "1"}, [], "uvloop"),
])
def test_the_echo_floor_runs_on_asyncios_loop_unless_asked(monkeypatch, env, argv, expected):
    """The echo floor is a plain gRPC service (asyncio's loop); --uvloop or GDN_ECHO_UVLOOP=1 (how
    bench/gpu_session.sh's `loops` part reaches the echo gdn-loadtest starts) put it on uvloop."""
    import gdn_client._echo as echo

    seen = []

    async def fake_serve(host: str, port: int) -> None:
        seen.append(await _loop_module())

    monkeypatch.setattr(echo, "serve", fake_serve)
    monkeypatch.delenv("GDN_ECHO_UVLOOP", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    try:
        echo.main(argv)
    finally:
        asyncio.set_event_loop_policy(None)
    assert seen == [expected]
