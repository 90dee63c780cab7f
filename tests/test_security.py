"""TLS, mutual TLS, bearer tokens, session ownership and the per-client session limit, end to end.

Certificates are made here with `cryptography` (a CA, a server certificate for 127.0.0.1 /
localhost, client certificates for alice and bob); the module skips without it.
"""
from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

import grpc
import pytest
import torch

from servers import SMALL_MODEL, start_server
from gdn_client import Client, ClientOptions, GdnError
from gdn_client.proto.gdn.v1 import gdn_pb2, gdn_pb2_grpc
from gdn_server.security import load_tokens
from util import cli_refusal, decode_request, random_inputs

x509 = pytest.importorskip("cryptography.x509")
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import NameOID  # noqa: E402

H, HV = 2, 4
TOKENS = "# test identities\nalice:tok-alice-0123456789\nbob:tok-bob-0123456789\n\nrotated-out-token\n"


# -- certificates ---------------------------------------------------------------------------
def _key():
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _cert(subject_cn: str, key, issuer_cn: str, issuer_key, *, ca: bool = False, server: bool = False):
    now = datetime.datetime.now(datetime.timezone.utc)
    b = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject_cn)]))
        .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer_cn)]))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if server:
        b = b.add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
    return b.sign(issuer_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("pki")
    ca_key = _key()
    files = {"ca.pem": _cert("gdn-test-ca", ca_key, "gdn-test-ca", ca_key, ca=True)}
    for name, server in (("server", True), ("alice", False), ("bob", False)):
        key = _key()
        files[f"{name}.pem"] = _cert(name, key, "gdn-test-ca", ca_key, server=server)
        files[f"{name}.key"] = _pem_key(key)
    other_ca = _key()  # a client certificate from a CA the server does not trust
    mallory = _key()
    files["mallory.pem"] = _cert("mallory", mallory, "other-ca", other_ca)
    files["mallory.key"] = _pem_key(mallory)
    out = {}
    for name, data in files.items():
        (d / name).write_bytes(data)
        out[name] = d / name
    return out


@pytest.fixture(scope="module")
def token_file(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("auth") / "tokens"
    p.write_text(TOKENS)
    return p


# -- helpers --------------------------------------------------------------------------------
def _tls_channel(address: str, pki, who: str | None = None) -> grpc.Channel:
    creds = grpc.ssl_channel_credentials(
        root_certificates=pki["ca.pem"].read_bytes(),
        private_key=pki[f"{who}.key"].read_bytes() if who else None,
        certificate_chain=pki[f"{who}.pem"].read_bytes() if who else None,
    )
    return grpc.secure_channel(address, creds)


def _md(token: str | None):
    return (("authorization", f"Bearer {token}"),) if token else ()


def _decode(stub, sid: str, token: str | None = None, position: int | None = None):
    inputs = random_inputs(1, 1, H, HV, gen=torch.Generator().manual_seed(1))
    req = decode_request(0, [sid], inputs, positions=None if position is None else [position])
    return stub.Decode(req, metadata=_md(token), timeout=10)


def _code(fn) -> grpc.StatusCode:
    try:
        fn()
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


# -- token file parsing ------------------------------------------------------------------------
def test_load_tokens(tmp_path):
    p = tmp_path / "t"
    p.write_text(TOKENS)
    tokens = load_tokens(p)
    assert tokens["tok-alice-0123456789"] == "alice" and tokens["tok-bob-0123456789"] == "bob"
    assert tokens["rotated-out-token"].startswith("token-")
    p.write_text("a:x\nb:x\n")
    with pytest.raises(ValueError, match="two names"):
        load_tokens(p)
    p.write_text("# nothing\n\n")
    with pytest.raises(ValueError, match="no tokens"):
        load_tokens(p)


# -- bearer tokens --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def token_server(token_file):
    with start_server(*SMALL_MODEL, "--auth-token-file", str(token_file), "--max-sessions-per-client", "3") as s:
        yield s


def test_every_rpc_needs_a_token(token_server):
    with grpc.insecure_channel(token_server.address) as ch:
        stub = gdn_pb2_grpc.GdnDecodeStub(ch)
        calls = {
            "GetModelInfo": lambda md: stub.GetModelInfo(gdn_pb2.GetModelInfoRequest(), metadata=md, timeout=10),
            "CreateSession": lambda md: stub.CreateSession(gdn_pb2.CreateSessionRequest(), metadata=md, timeout=10),
            "CloseSession": lambda md: stub.CloseSession(gdn_pb2.CloseSessionRequest(session_id="x"), metadata=md,
                                                        timeout=10),
            "Decode": lambda md: stub.Decode(gdn_pb2.DecodeRequest(), metadata=md, timeout=10),
            "DecodeStream": lambda md: list(stub.DecodeStream(iter([gdn_pb2.DecodeRequest()]), metadata=md,
                                                              timeout=10)),
            "ExportState": lambda md: list(stub.ExportState(gdn_pb2.ExportStateRequest(session_id="x"),
                                                            metadata=md, timeout=10)),
            "ImportState": lambda md: stub.ImportState(iter([]), metadata=md, timeout=10),
            "GetStats": lambda md: stub.GetStats(gdn_pb2.GetStatsRequest(), metadata=md, timeout=10),
        }
        bad = [(), (("authorization", "Bearer wrong"),), (("authorization", "tok-alice-0123456789"),),
               (("authorization", "Basic tok-alice-0123456789"),)]
        for name, call in calls.items():
            for md in bad:
                assert _code(lambda: call(md)) == grpc.StatusCode.UNAUTHENTICATED, (name, md)
        # with a valid token the same calls get past auth (to whatever their own answer is)
        for name, call in calls.items():
            assert _code(lambda: call(_md("tok-bob-0123456789"))) != grpc.StatusCode.UNAUTHENTICATED, name
        # the scheme is case-insensitive; a bare-token line is an identity too
        stub.GetModelInfo(gdn_pb2.GetModelInfoRequest(), metadata=(("authorization", "bearer rotated-out-token"),))


def test_health_needs_no_token(token_server):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(token_server.address) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_sessions_belong_to_their_creator(token_server):
    alice, bob = "tok-alice-0123456789", "tok-bob-0123456789"
    with grpc.insecure_channel(token_server.address) as ch:
        stub = gdn_pb2_grpc.GdnDecodeStub(ch)
        sid = stub.CreateSession(gdn_pb2.CreateSessionRequest(), metadata=_md(alice)).session_id
        denied = grpc.StatusCode.PERMISSION_DENIED
        assert _code(lambda: _decode(stub, sid, bob, position=0)) == denied
        assert _code(lambda: stub.CloseSession(gdn_pb2.CloseSessionRequest(session_id=sid), metadata=_md(bob))) == denied
        assert _code(lambda: stub.ForkSession(gdn_pb2.ForkSessionRequest(session_id=sid), metadata=_md(bob))) == denied
        assert _code(lambda: list(stub.ExportState(gdn_pb2.ExportStateRequest(session_id=sid),
                                                   metadata=_md(bob)))) == denied
        assert _code(lambda: stub.CreateSession(gdn_pb2.CreateSessionRequest(colocate_with=sid),
                                                metadata=_md(bob))) == denied
        # a request mixing a foreign session with one's own is refused whole
        own = stub.CreateSession(gdn_pb2.CreateSessionRequest(), metadata=_md(bob)).session_id
        inputs = random_inputs(2, 1, H, HV, gen=torch.Generator().manual_seed(2))
        mixed = decode_request(0, [own, sid], inputs, positions=[0, 0])
        assert _code(lambda: stub.Decode(mixed, metadata=_md(bob))) == denied
        # in a stream, the foreign request gets error_code 7 and the stream goes on
        good = decode_request(0, [own], random_inputs(1, 1, H, HV), positions=[0])
        replies = list(stub.DecodeStream(iter([mixed, good]), metadata=_md(bob), timeout=10))
        assert [r.error_code for r in replies] == [denied.value[0], 0]
        # nothing bob tried moved alice's session: her first step is still at position 0
        assert list(_decode(stub, sid, alice, position=0).positions) == [1]
        stub.CloseSession(gdn_pb2.CloseSessionRequest(session_id=sid), metadata=_md(alice))
        stub.CloseSession(gdn_pb2.CloseSessionRequest(session_id=own), metadata=_md(bob))


def test_max_sessions_per_client(token_server):
    alice, bob = "tok-alice-0123456789", "tok-bob-0123456789"
    with grpc.insecure_channel(token_server.address) as ch:
        stub = gdn_pb2_grpc.GdnDecodeStub(ch)
        create = lambda tok: stub.CreateSession(gdn_pb2.CreateSessionRequest(), metadata=_md(tok)).session_id  # noqa: E731
        mine = [create(alice) for _ in range(3)]
        assert _code(lambda: create(alice)) == grpc.StatusCode.RESOURCE_EXHAUSTED
        # a fork counts too
        assert _code(lambda: stub.ForkSession(gdn_pb2.ForkSessionRequest(session_id=mine[0]),
                                              metadata=_md(alice))) == grpc.StatusCode.RESOURCE_EXHAUSTED
        theirs = create(bob)  # another client is not affected
        stub.CloseSession(gdn_pb2.CloseSessionRequest(session_id=mine.pop()), metadata=_md(alice))
        mine.append(create(alice))  # closing frees a place
        for sid in mine:
            stub.CloseSession(gdn_pb2.CloseSessionRequest(session_id=sid), metadata=_md(alice))
        stub.CloseSession(gdn_pb2.CloseSessionRequest(session_id=theirs), metadata=_md(bob))


def test_client_library_sends_the_token(token_server):
    opts = ClientOptions(timeout=10, token="tok-alice-0123456789")
    with Client(token_server.address, opts) as client:
        with client.session() as s:
            o = s.decode(0, *(random_inputs(1, 1, H, HV)[n][0] for n in "qkvab"))
            assert o.shape[-1] == 128
    with Client(token_server.address, opts.replace(token="nope", max_attempts=1)) as client:
        with pytest.raises(GdnError) as e:
            client.model_info()
        assert e.value.code == grpc.StatusCode.UNAUTHENTICATED


# -- TLS and mutual TLS ----------------------------------------------------------------------
def test_tls(pki):
    with start_server(*SMALL_MODEL, "--tls-cert", str(pki["server.pem"]), "--tls-key", str(pki["server.key"])) as s:
        with _tls_channel(s.address, pki) as ch:
            stub = gdn_pb2_grpc.GdnDecodeStub(ch)
            sid = stub.CreateSession(gdn_pb2.CreateSessionRequest(), timeout=10).session_id
            assert list(_decode(stub, sid, position=0).positions) == [1]
        with grpc.insecure_channel(s.address) as ch:  # plaintext cannot talk to a TLS port
            stub = gdn_pb2_grpc.GdnDecodeStub(ch)
            assert _code(lambda: stub.GetModelInfo(gdn_pb2.GetModelInfoRequest(), timeout=5)) == \
                grpc.StatusCode.UNAVAILABLE
        opts = ClientOptions(timeout=10, root_certificates=pki["ca.pem"].read_bytes())
        with Client(s.address, opts) as client:
            assert client.model_info().num_layers == 3


def test_mutual_tls_identity(pki):
    flags = ("--tls-cert", str(pki["server.pem"]), "--tls-key", str(pki["server.key"]),
             "--tls-client-ca", str(pki["ca.pem"]), "--max-sessions-per-client", "2")
    with start_server(*SMALL_MODEL, *flags) as s:
        for who in (None, "mallory"):  # no certificate, or one the server does not trust
            with _tls_channel(s.address, pki, who) as ch:
                stub = gdn_pb2_grpc.GdnDecodeStub(ch)
                assert _code(lambda: stub.GetModelInfo(gdn_pb2.GetModelInfoRequest(), timeout=5)) == \
                    grpc.StatusCode.UNAVAILABLE
        with _tls_channel(s.address, pki, "alice") as a, _tls_channel(s.address, pki, "bob") as b:
            alice, bob = gdn_pb2_grpc.GdnDecodeStub(a), gdn_pb2_grpc.GdnDecodeStub(b)
            sid = alice.CreateSession(gdn_pb2.CreateSessionRequest(), timeout=10).session_id
            assert _code(lambda: _decode(bob, sid, position=0)) == grpc.StatusCode.PERMISSION_DENIED
            assert list(_decode(alice, sid, position=0).positions) == [1]
            alice.CreateSession(gdn_pb2.CreateSessionRequest(), timeout=10)
            assert _code(lambda: alice.CreateSession(gdn_pb2.CreateSessionRequest(), timeout=10)) == \
                grpc.StatusCode.RESOURCE_EXHAUSTED
            bob.CreateSession(gdn_pb2.CreateSessionRequest(), timeout=10)
        opts = ClientOptions(timeout=10, root_certificates=pki["ca.pem"].read_bytes(),
                             private_key=pki["bob.key"].read_bytes(), certificate_chain=pki["bob.pem"].read_bytes())
        with Client(s.address, opts) as client:
            assert client.model_info().num_layers == 3


def test_bad_security_flags_are_refused(tmp_path, pki):
    import subprocess
    import sys

    assert "--tls-key" in cli_refusal(*SMALL_MODEL, "--tls-cert", str(pki["server.pem"]))
    cli_refusal(*SMALL_MODEL, "--tls-client-ca", str(pki["ca.pem"]))

    def run(*flags):  # token files are read as the server is built: a process of its own
        return subprocess.run([sys.executable, "-m", "gdn_server", "--device", "cpu", "--port", "0", *SMALL_MODEL,
                               *flags], capture_output=True, text=True, timeout=60)

    empty = tmp_path / "empty"
    empty.write_text("\n")
    r = run("--auth-token-file", str(empty))
    assert r.returncode == 2 and "no tokens" in r.stderr
    r = run("--auth-token-file", str(tmp_path / "missing"))
    assert r.returncode == 2
