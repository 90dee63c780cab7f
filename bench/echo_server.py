"""gRPC bytes echo server: the floor that `gdn-loadtest --echo` measures our service against.

    python bench/echo_server.py --host 127.0.0.1 --port 0     # prints "listening on HOST:PORT"

Service ``gdn.bench.Echo`` with ``Unary`` and bidi ``Stream`` methods on raw bytes (grpc generic
handlers, no proto). A request is a 4-byte little-endian reply size plus payload; the reply is
that many bytes. The implementation lives in `gdn_client._echo` so an installed `gdn-loadtest`
can start it without a checkout; a client that drives it is `gdn_client.loadtest` (``--echo``).
"""
from gdn_client._echo import main

if __name__ == "__main__":
    main()
