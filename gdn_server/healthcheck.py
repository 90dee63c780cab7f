"""`python -m gdn_server.healthcheck`: a grpc.health.v1 probe (the image's HEALTHCHECK, k8s exec probes).

Exits 0 when the server answers SERVING, 1 when it answers anything else (NOT_SERVING while it
starts or drains), 2 when it cannot be reached in time. Flags default from the environment so a
container can probe itself with no arguments:

    --address   GDN_HEALTHCHECK_ADDRESS, else 127.0.0.1:$GDN_PORT (default port 50051)
    --service   GDN_HEALTHCHECK_SERVICE ("" = the whole server)
    --tls-ca    GDN_HEALTHCHECK_TLS_CA, else GDN_TLS_CA: CA that signed the server (turns TLS on)
    --tls-cert / --tls-key   GDN_HEALTHCHECK_TLS_CERT / _KEY: client certificate for mutual TLS
    --server-name            GDN_HEALTHCHECK_SERVER_NAME: TLS name to check instead of the host

The health service needs no bearer token.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def _env(*names: str, default: str | None = None) -> str | None:
    for name in names:
        value = os.environ.get(name)
        if value:
            return value
    return default


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m gdn_server.healthcheck", description=__doc__.splitlines()[0])
    p.add_argument("--address", default=_env("GDN_HEALTHCHECK_ADDRESS",
                                               default=f"127.0.0.1:{os.environ.get('GDN_PORT') or 50051}"))
    p.add_argument("--service", default=_env("GDN_HEALTHCHECK_SERVICE", default=""))
    p.add_argument("--timeout", type=float, default=float(_env("GDN_HEALTHCHECK_TIMEOUT", default="3")))
    p.add_argument("--tls-ca", default=_env("GDN_HEALTHCHECK_TLS_CA", "GDN_TLS_CA"))
    p.add_argument("--tls-cert", default=_env("GDN_HEALTHCHECK_TLS_CERT"))
    p.add_argument("--tls-key", default=_env("GDN_HEALTHCHECK_TLS_KEY"))
    p.add_argument("--server-name", default=_env("GDN_HEALTHCHECK_SERVER_NAME"))
    return p


def check(address: str, service: str = "", timeout: float = 3.0, tls_ca: str | None = None,
          tls_cert: str | None = None, tls_key: str | None = None, server_name: str | None = None) -> int:
    """The probe's exit status: 0 SERVING, 1 another status, 2 unreachable."""
    if tls_ca or tls_cert:
        creds = grpc.ssl_channel_credentials(
            root_certificates=Path(tls_ca).read_bytes() if tls_ca else None,
            private_key=Path(tls_key).read_bytes() if tls_key else None,
            certificate_chain=Path(tls_cert).read_bytes() if tls_cert else None,
        )
        options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
        channel = grpc.secure_channel(address, creds, options=options)
    else:
        channel = grpc.insecure_channel(address)
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.RpcError as e:
            print(f"unhealthy: {e.code().name}: {e.details()}", file=sys.stderr)
            return 2
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(status)
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    return check(a.address, a.service, a.timeout, a.tls_ca, a.tls_cert, a.tls_key, a.server_name)


if __name__ == "__main__":
    raise SystemExit(main())
