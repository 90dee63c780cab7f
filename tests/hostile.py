"""Hostile HTTP/2 clients for the admission tests: raw connections (the `h2` library, flow control
obeyed as a real client must) that open many gRPC calls and then park them, with headers only or
with part of a message, and never finish them.

`park(port, connections, streams, ...)` returns a `Parked` whose `close()` drops every connection;
each connection's reader thread keeps answering the server's pings and settings and records the
streams the server ended (`ended`), so a test can tell refused calls from held ones.
"""
from __future__ import annotations

import socket
import struct
import threading
import time
from dataclasses import dataclass, field

import h2.config
import h2.connection
import h2.events
import h2.exceptions


@dataclass
class _Conn:
    sock: socket.socket
    h2: h2.connection.H2Connection
    lock: threading.Lock = field(default_factory=threading.Lock)
    pending: dict[int, bytes] = field(default_factory=dict)  # stream -> bytes still to send
    sent: dict[int, int] = field(default_factory=dict)  # stream -> data bytes the server let in
    ended: dict[int, str] = field(default_factory=dict)  # stream -> how the server ended it
    closed: bool = False

    def flush(self) -> None:
        data = self.h2.data_to_send()
        if data:
            self.sock.sendall(data)

    def push(self) -> None:
        """Sends whatever flow control now allows of each stream's unsent bytes."""
        for stream, rest in list(self.pending.items()):
            if stream in self.ended:
                del self.pending[stream]
                continue
            try:
                window = min(self.h2.local_flow_control_window(stream), self.h2.max_outbound_frame_size)
            except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError, KeyError):
                del self.pending[stream]
                continue
            while rest and window > 0:
                piece, rest = rest[:window], rest[window:]
                self.h2.send_data(stream, piece)
                self.sent[stream] = self.sent.get(stream, 0) + len(piece)
                window = min(self.h2.local_flow_control_window(stream), self.h2.max_outbound_frame_size)
            if rest:
                self.pending[stream] = rest
            else:
                del self.pending[stream]
        self.flush()


@dataclass
class Parked:
    conns: list[_Conn]
    threads: list[threading.Thread]

    @property
    def ended(self) -> int:
        """Streams the server has ended (reset or answered with a status)."""
        return sum(len(c.ended) for c in self.conns)

    @property
    def let_in(self) -> int:
        """Message bytes the server's flow control has let the hostile client send, in all."""
        return sum(sum(c.sent.values()) for c in self.conns)

    def codes(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for c in self.conns:
            for how in c.ended.values():
                out[how] = out.get(how, 0) + 1
        return out

    def close(self) -> None:
        for c in self.conns:
            c.closed = True
            try:
                c.sock.shutdown(socket.SHUT_RDWR)  # wakes the reader blocked in recv
                c.sock.close()
            except OSError:
                pass
        for t in self.threads:
            t.join(5)


def _read(conn: _Conn) -> None:
    while not conn.closed:
        try:
            data = conn.sock.recv(1 << 16)
        except OSError:
            return
        if not data:
            return
        with conn.lock:
            try:
                events = conn.h2.receive_data(data)
            except h2.exceptions.ProtocolError:
                return
            for ev in events:
                if isinstance(ev, h2.events.StreamReset):
                    conn.ended.setdefault(ev.stream_id, f"reset {ev.error_code}")
                elif isinstance(ev, h2.events.TrailersReceived):
                    status = dict(ev.headers).get(b"grpc-status", b"?").decode()
                    conn.ended[ev.stream_id] = f"grpc-status {status}"
                elif isinstance(ev, h2.events.ResponseReceived):
                    status = dict(ev.headers).get(b"grpc-status")  # trailers-only answer
                    if status is not None:
                        conn.ended[ev.stream_id] = f"grpc-status {status.decode()}"
            try:
                conn.push()
            except OSError:
                return


def park(port: int, connections: int, streams: int, *, method: str = "/gdn.v1.GdnDecode/Decode",
         token: str | None = None, declared: int = 0, sent: int = 0, timeout: float = 10.0) -> Parked:
    """Opens `connections` connections of `streams` calls each and parks them: headers only when
    `declared` is 0, else a message prefix declaring `declared` bytes followed by up to `sent` of
    them (as far as flow control lets them in). Returns once every call has been opened, or after
    `timeout` seconds."""
    headers = [(":method", "POST"), (":scheme", "http"), (":path", method), (":authority", "127.0.0.1"),
               ("content-type", "application/grpc"), ("te", "trailers")]
    if token is not None:
        headers.append(("authorization", f"Bearer {token}"))
    conns, threads = [], []
    deadline = time.monotonic() + timeout
    for _ in range(connections):
        sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        sock.settimeout(None)
        conn = _Conn(sock, h2.connection.H2Connection(h2.config.H2Configuration(client_side=True)))
        with conn.lock:
            conn.h2.initiate_connection()
            conn.flush()
        reader = threading.Thread(target=_read, args=(conn,), daemon=True)
        reader.start()
        conns.append(conn)
        threads.append(reader)
        opened = 0
        while opened < streams and time.monotonic() < deadline:
            with conn.lock:
                try:
                    stream = conn.h2.get_next_available_stream_id()
                    conn.h2.send_headers(stream, headers)
                except h2.exceptions.TooManyStreamsError:
                    stream = None
                if stream is not None:
                    opened += 1
                    if declared:
                        conn.pending[stream] = b"\0" + struct.pack(">I", declared) + bytes(min(sent, declared))
                    try:
                        conn.push()
                    except OSError:
                        break
            if stream is None:
                time.sleep(0.01)  # the server's stream limit: wait for it to end some
    return Parked(conns, threads)
