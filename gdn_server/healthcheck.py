"""`python -m gdn_server.healthcheck`: a grpc.health.v1 probe (the image's HEALTHCHECK, k8s exec probes).

It asks the server's health service about one service name once and exits with a code that tells
the outcomes apart, so an orchestrator's log or a shell script can say *why* a probe failed:

    0  SERVING
    1  the server answered another status: NOT_SERVING (starting, or draining after SIGTERM),
       UNKNOWN or SERVICE_UNKNOWN
    2  unreachable: no connection, or no answer within --timeout (UNAVAILABLE, DEADLINE_EXCEEDED)
    3  the server does not know --service (the health service answers NOT_FOUND); a typo in the
       probe's configuration, not an unhealthy server
    4  any other RPC failure (e.g. UNIMPLEMENTED: no health service at that address)
    64 bad command line, or a TLS file that cannot be read (EX_USAGE of sysexits.h)

Docker and Kubernetes treat every non-zero code as "unhealthy"; the distinct codes are for people.
A bad flag exits 64, not argparse's usual 2, so that 2 always means "unreachable".

Flags default from the environment so a container can probe itself with no arguments:

    --address   GDN_HEALTHCHECK_ADDRESS, else 127.0.0.1:$GDN_PORT (default port 50051)
    --service   GDN_HEALTHCHECK_SERVICE ("" = the whole server; "gdn.v1.GdnDecode" also exists)
    --timeout   GDN_HEALTHCHECK_TIMEOUT, seconds (default 3)
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
from typing import NoReturn

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

EXIT_SERVING = 0
EXIT_NOT_SERVING = 1
EXIT_UNREACHABLE = 2
EXIT_UNKNOWN_SERVICE = 3
EXIT_RPC_ERROR = 4
EXIT_USAGE = 64

# no answer at all: the server is down, not listening yet, or too slow to answer in time
_UNREACHABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


def _env(*names: str, default: str | None = None) -> str | None:
    for name in names:
        value = os.environ.get(name)
        if value:
            return value
    return default


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # argparse exits 2 on a bad flag, which would read as "unreachable" here
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    # the module docstring is the help text: the exit codes and environment are documented once
    p = _Parser(prog="python -m gdn_server.healthcheck", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--address", default=_env("GDN_HEALTHCHECK_ADDRESS",
                                               default=f"127.0.0.1:{os.environ.get('GDN_PORT') or 50051}"),
                   help="HOST:PORT of the server (default %(default)s)")
    p.add_argument("--service", default=_env("GDN_HEALTHCHECK_SERVICE", default=""),
                   help='service name to ask about ("" = the whole server, the default)')
    p.add_argument("--timeout", type=float, default=float(_env("GDN_HEALTHCHECK_TIMEOUT", default="3")),
                   help="seconds to wait for an answer (default %(default)s)")
    p.add_argument("--tls-ca", default=_env("GDN_HEALTHCHECK_TLS_CA", "GDN_TLS_CA"),
                   help="PEM CA that signed the server's certificate (turns TLS on)")
    p.add_argument("--tls-cert", default=_env("GDN_HEALTHCHECK_TLS_CERT"), help="PEM client certificate (mutual TLS)")
    p.add_argument("--tls-key", default=_env("GDN_HEALTHCHECK_TLS_KEY"), help="PEM key of --tls-cert")
    p.add_argument("--server-name", default=_env("GDN_HEALTHCHECK_SERVER_NAME"),
                   help="TLS name to verify instead of the address's host")
    return p


def _channel(address: str, tls_ca: str | None, tls_cert: str | None, tls_key: str | None,
             server_name: str | None) -> grpc.Channel:
    if not (tls_ca or tls_cert):
        return grpc.insecure_channel(address)
    creds = grpc.ssl_channel_credentials(
        root_certificates=Path(tls_ca).read_bytes() if tls_ca else None,
        private_key=Path(tls_key).read_bytes() if tls_key else None,
        certificate_chain=Path(tls_cert).read_bytes() if tls_cert else None,
    )
    options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    return grpc.secure_channel(address, creds, options=options)


def check(address: str, service: str = "", timeout: float = 3.0, tls_ca: str | None = None,
          tls_cert: str | None = None, tls_key: str | None = None, server_name: str | None = None) -> int:
    """The probe's exit code (the EXIT_* constants, listed in the module docstring)."""
    try:
        channel = _channel(address, tls_ca, tls_cert, tls_key, server_name)
    except OSError as e:
        print(f"cannot read a TLS file: {e}", file=sys.stderr)
        return EXIT_USAGE
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.RpcError as e:
            code = e.code()
            if code in _UNREACHABLE:
                print(f"unreachable: {code.name}: {e.details()}", file=sys.stderr)
                return EXIT_UNREACHABLE
            if code == grpc.StatusCode.NOT_FOUND:
                print(f"unknown service {service!r}: the server does not report its health", file=sys.stderr)
                return EXIT_UNKNOWN_SERVICE
            print(f"health check failed: {code.name}: {e.details()}", file=sys.stderr)
            return EXIT_RPC_ERROR
    print(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
    return EXIT_SERVING if reply.status == health_pb2.HealthCheckResponse.SERVING else EXIT_NOT_SERVING


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    return check(a.address, a.service, a.timeout, a.tls_ca, a.tls_cert, a.tls_key, a.server_name)


if __name__ == "__main__":
    raise SystemExit(main())
