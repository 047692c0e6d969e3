"""A fault-injecting HTTP/1.1 proxy for the tests, in front of an S3 API test server.

Loopback only, bounded: at most ``max_connections`` client connections are served at
once (one thread each), every socket has a timeout, and :meth:`FaultProxy.close`
returns within a few seconds. Requests are forwarded byte for byte, ``Host`` header
included, so S3 signature V4 signatures (which sign the host the client connected to,
the proxy) stay valid on the server behind it. Bodies stream through in chunks (a
multi-megabyte part is never held whole).

Faults, switchable at runtime (one rule at a time, chosen per request by a seeded
random draw, optionally restricted by method, path, ranged GETs, and a count limit)::

    with FaultProxy(server.endpoint_url) as proxy:
        options = {**server.storage_options(), "endpoint_url": proxy.endpoint_url}
        proxy.throttle(0.2, retry_after="1")      # 20 % answered 503 SlowDown
        proxy.reset(1.0, methods={"PUT"}, limit=1)  # cut the next upload mid-body
        proxy.delay(5.0)                          # every response 5 s late
        proxy.hold(20.0, methods={"PUT"}, path_contains="manifest.json")
        proxy.release()                           # ... held requests go on now
        proxy.truncate(0.5, ranged_only=True)     # half the ranged GETs cut short
        proxy.corrupt(1.0)                        # one byte of every GET body flipped
        proxy.corrupt(1.0, offset=0)              # ... the first one
        proxy.kill(); proxy.revive()              # the server dies, and comes back
        proxy.clear()
        proxy.stats()                             # requests seen, faults injected

A throttled request that announced ``Expect: 100-continue`` is answered before its
body is sent (as S3 does), and that connection is then closed.
"""

from __future__ import annotations

import contextlib
import random
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import BinaryIO
from urllib.parse import urlsplit

LOOPBACK = "127.0.0.1"
CHUNK = 64 * 1024
ACCEPT_POLL_S = 0.05
JOIN_TIMEOUT_S = 3.0
NO_BODY_STATUSES = frozenset({204, 304})
ERROR_CODES = {
    503: ("SlowDown", "Please reduce your request rate."),
    500: ("InternalError", "We encountered an internal error. Please try again."),
    502: ("BadGateway", "Bad gateway."),
    504: ("GatewayTimeout", "Gateway timeout."),
    429: ("TooManyRequests", "Too many requests."),
}


class ProxyKilled(Exception):
    """The proxy was killed while this connection was being served."""


@dataclass(frozen=True)
class Rule:
    """One kind of fault and the requests it may hit.

    Attributes:
        kind: ``"status"``, ``"reset"``, ``"delay"``, ``"hold"``, ``"truncate"`` or
            ``"corrupt"``.
        fraction: probability (0..1) that a matching request gets the fault.
        methods: HTTP methods it applies to (None: all).
        path_contains: only requests whose target contains this (None: all).
        ranged_only: only requests with a ``Range`` header.
        limit: at most this many faults (None: unbounded).
        status: the error status of ``"status"`` rules.
        retry_after: the ``Retry-After`` header value of ``"status"`` rules (None: none).
        seconds: the delay of ``"delay"`` rules, the longest hold of ``"hold"`` ones.
        offset: the byte of the body a ``"corrupt"`` rule flips (None: the middle one;
            past the end: the last one).
    """

    kind: str
    fraction: float = 1.0
    methods: frozenset[str] | None = None
    path_contains: str | None = None
    ranged_only: bool = False
    limit: int | None = None
    status: int = 503
    retry_after: str | None = None
    seconds: float = 0.0
    offset: int | None = None

    def matches(self, request: Request) -> bool:
        return (
            (self.methods is None or request.method in self.methods)
            and (self.path_contains is None or self.path_contains in request.target)
            and (not self.ranged_only or "range" in request.headers)
        )


@dataclass(frozen=True)
class ProxyStats:
    """Counters since the proxy started (or :meth:`FaultProxy.reset_counters`)."""

    requests: int
    forwarded: int
    faults: dict[str, int] = field(default_factory=dict)
    by_method: dict[str, int] = field(default_factory=dict)

    @property
    def total_faults(self) -> int:
        return sum(self.faults.values())


@dataclass
class Request:
    """A request's head as read from the client."""

    method: str
    target: str
    head: bytes  # the raw request line and headers, forwarded unchanged
    headers: dict[str, str]  # lower-case names

    @property
    def expects_continue(self) -> bool:
        return self.headers.get("expect", "").lower() == "100-continue"


class FaultProxy:
    """An HTTP proxy on a free loopback port in front of ``upstream`` (an
    ``http://host:port`` URL on loopback); use as a context manager."""

    def __init__(
        self,
        upstream: str,
        *,
        seed: int = 0,
        max_connections: int = 64,
        io_timeout_s: float = 30.0,
    ) -> None:
        parts = urlsplit(upstream)
        if parts.scheme != "http" or parts.hostname not in {LOOPBACK, "localhost"}:
            raise ValueError(f"the fault proxy forwards to loopback http only, not {upstream}")
        self.upstream = (LOOPBACK, parts.port or 80)
        self.io_timeout_s = io_timeout_s
        self._random = random.Random(seed)
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(max_connections)
        self._rule: Rule | None = None
        self._injected = 0
        self._counts: Counter[str] = Counter()
        self._sockets: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self._closed = threading.Event()
        self._killed = threading.Event()
        self._released = threading.Event()
        self._listener: socket.socket | None = None
        self._acceptor: threading.Thread | None = None
        self.port = 0

    # -- lifecycle ------------------------------------------------------------------------

    @property
    def endpoint_url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def start(self) -> FaultProxy:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((LOOPBACK, self.port))
        listener.listen(128)
        listener.settimeout(ACCEPT_POLL_S)
        self.port = listener.getsockname()[1]
        self._listener = listener
        self._killed.clear()
        self._acceptor = threading.Thread(
            target=self._accept_loop, args=(listener,), name="faultproxy-accept", daemon=True
        )
        self._acceptor.start()
        return self

    def close(self) -> None:
        """Stop accepting, cut every connection and wait (bounded) for the threads."""
        self._closed.set()
        self.kill()
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        for thread in list(self._threads):
            thread.join(max(0.0, deadline - time.monotonic()))

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def kill(self) -> None:
        """Stop entirely, like a killed server: new connections are refused and open
        ones are reset."""
        self._killed.set()
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
        if self._acceptor is not None:
            self._acceptor.join(JOIN_TIMEOUT_S)
            self._acceptor = None
        with self._lock:
            doomed = list(self._sockets)
        for sock in doomed:
            _abort(sock)

    def revive(self) -> None:
        """Listen again on the same port after :meth:`kill`."""
        if self._listener is None and not self._closed.is_set():
            self.start()

    # -- faults ---------------------------------------------------------------------------

    def set_rule(self, rule: Rule | None) -> None:
        """Apply ``rule`` from the next request on (None: forward everything)."""
        with self._lock:
            self._rule = rule
            self._injected = 0
            self._released.clear()

    def clear(self) -> None:
        self.set_rule(None)

    def throttle(
        self,
        fraction: float,
        *,
        retry_after: str | float | None = None,
        status: int = 503,
        **match: object,
    ) -> None:
        """Answer ``fraction`` of the requests with ``status`` (503 SlowDown) and an S3
        XML error body, with a ``Retry-After`` header when ``retry_after`` is given."""
        after = None if retry_after is None else str(retry_after)
        self.set_rule(_rule("status", fraction, match, status=status, retry_after=after))

    def reset(self, fraction: float, **match: object) -> None:
        """Reset the connection halfway through the body (the request's if it has one,
        else the response's)."""
        self.set_rule(_rule("reset", fraction, match))

    def delay(self, seconds: float, fraction: float = 1.0, **match: object) -> None:
        """Hold the response ``seconds`` before sending it."""
        self.set_rule(_rule("delay", fraction, match, seconds=seconds))

    def hold(self, seconds: float, fraction: float = 1.0, **match: object) -> None:
        """Hold the request ``seconds`` before forwarding it (it reaches the server
        late), or until :meth:`release`; ``stats().faults["hold"]`` counts those held."""
        self.set_rule(_rule("hold", fraction, match, seconds=seconds))

    def release(self) -> None:
        """Let the held requests (and the next ones the rule matches) go on now."""
        self._released.set()

    def truncate(self, fraction: float, *, ranged_only: bool = False, **match: object) -> None:
        """Send only the first half of a GET response's body, then close."""
        match.setdefault("methods", {"GET"})
        self.set_rule(_rule("truncate", fraction, match, ranged_only=ranged_only))

    def corrupt(
        self,
        fraction: float,
        *,
        ranged_only: bool = False,
        offset: int | None = None,
        **match: object,
    ) -> None:
        """Flip the bits of one byte of a GET response's body: the one at ``offset``
        (the last one when the body is shorter), or the middle one."""
        match.setdefault("methods", {"GET"})
        self.set_rule(_rule("corrupt", fraction, match, ranged_only=ranged_only, offset=offset))

    def stats(self) -> ProxyStats:
        with self._lock:
            counts = dict(self._counts)
        return ProxyStats(
            requests=counts.get("requests", 0),
            forwarded=counts.get("forwarded", 0),
            faults={k[6:]: v for k, v in counts.items() if k.startswith("fault:")},
            by_method={k[7:]: v for k, v in counts.items() if k.startswith("method:")},
        )

    def reset_counters(self) -> None:
        with self._lock:
            self._counts.clear()

    def _draw(self, request: Request) -> Rule | None:
        with self._lock:
            self._counts["requests"] += 1
            self._counts[f"method:{request.method}"] += 1
            rule = self._rule
            if rule is None or not rule.matches(request):
                return None
            if rule.limit is not None and self._injected >= rule.limit:
                return None
            if self._random.random() >= rule.fraction:
                return None
            self._injected += 1
            self._counts[f"fault:{rule.kind}"] += 1
            return rule

    def _count(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1

    # -- serving --------------------------------------------------------------------------

    def _accept_loop(self, listener: socket.socket) -> None:
        while not self._killed.is_set():
            if not self._slots.acquire(timeout=ACCEPT_POLL_S):
                continue
            try:
                client, _ = listener.accept()
            except OSError:  # timeout, or the listener was closed by kill()
                self._slots.release()
                continue
            thread = threading.Thread(
                target=self._serve, args=(client,), name="faultproxy-conn", daemon=True
            )
            with self._lock:
                self._threads.add(thread)
            thread.start()

    def _serve(self, client: socket.socket) -> None:
        try:
            with self._tracked(client):
                client.settimeout(self.io_timeout_s)
                reader = client.makefile("rb")
                with contextlib.closing(reader):
                    while not self._killed.is_set() and self._serve_one(client, reader):
                        pass
        except (OSError, ProxyKilled, ValueError):
            pass  # the client, the server or kill() ended the connection
        finally:
            self._slots.release()
            with self._lock:
                self._threads.discard(threading.current_thread())

    @contextlib.contextmanager
    def _tracked(self, sock: socket.socket) -> Iterator[socket.socket]:
        with self._lock:
            self._sockets.add(sock)
        try:
            yield sock
        finally:
            with self._lock:
                self._sockets.discard(sock)
            sock.close()

    def _serve_one(self, client: socket.socket, reader: BinaryIO) -> bool:
        """Serve one request; False when the connection must be closed."""
        request = _read_head(reader)
        if request is None:
            return False
        rule = self._draw(request)
        if rule is not None and rule.kind == "status":
            return self._answer_error(client, reader, request, rule)
        if request.expects_continue:  # the body comes after this; the server gets none
            client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
            request.head = _drop_header(request.head, b"expect")
        if rule is not None and rule.kind == "hold":
            self._released.wait(rule.seconds)
            if self._killed.is_set():
                raise ProxyKilled
        upstream = socket.create_connection(self.upstream, timeout=self.io_timeout_s)
        with self._tracked(upstream):
            upstream.sendall(request.head)
            cut = rule is not None and rule.kind == "reset" and _has_body(request.headers)
            if not _relay_body(reader, upstream, request.headers, cut_at_half=cut):
                _abort(client)
                return False
            self._count("forwarded")
            return self._relay_response(client, upstream, request, rule)

    def _answer_error(
        self, client: socket.socket, reader: BinaryIO, request: Request, rule: Rule
    ) -> bool:
        keep = not request.expects_continue  # else the client never sends the body
        if keep:
            _relay_body(reader, None, request.headers)
        code, message = ERROR_CODES.get(rule.status, ("Error", "Injected error."))
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Error><Code>{code}</Code><Message>{message}</Message>"
            f"<Resource>{request.target.split('?')[0]}</Resource>"
            "<RequestId>FAULTPROXY</RequestId></Error>"
        ).encode()
        headers = [
            f"HTTP/1.1 {rule.status} {code}",
            "Content-Type: application/xml",
            f"Content-Length: {len(body)}",
            f"Connection: {'keep-alive' if keep else 'close'}",
        ]
        if rule.retry_after is not None:
            headers.append(f"Retry-After: {rule.retry_after}")
        payload = ("\r\n".join(headers) + "\r\n\r\n").encode()
        client.sendall(payload if request.method == "HEAD" else payload + body)
        return keep

    def _relay_response(
        self, client: socket.socket, upstream: socket.socket, request: Request, rule: Rule | None
    ) -> bool:
        up_reader = upstream.makefile("rb")
        with contextlib.closing(up_reader):
            status, head, headers = _read_response_head(up_reader)
            if rule is not None and rule.kind == "delay" and self._killed.wait(rule.seconds):
                raise ProxyKilled
            client.sendall(head)
            if request.method == "HEAD" or status in NO_BODY_STATUSES or status < 200:
                return True
            kind = rule.kind if rule is not None else None
            if kind in {"truncate", "corrupt", "reset"} and "content-length" in headers:
                length = int(headers["content-length"])
                return _relay_faulty(up_reader, client, length, kind, _flip_at(rule, length))
            complete = _relay_body(up_reader, client, headers, until_close=True)
            return complete and headers.get("connection", "").lower() != "close"


def _rule(kind: str, fraction: float, match: dict[str, object], **values: object) -> Rule:
    methods = match.pop("methods", None)
    if methods is not None:
        match["methods"] = frozenset(str(m).upper() for m in methods)  # type: ignore[attr-defined]
    return Rule(kind, fraction, **match, **values)  # type: ignore[arg-type]


def _abort(sock: socket.socket) -> None:
    """Reset ``sock`` (RST, not FIN) and wake any thread blocked on it."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()


def _read_head(reader: BinaryIO) -> Request | None:
    lines = _read_lines(reader)
    if not lines:
        return None
    method, target, _ = lines[0].decode("latin-1").split(" ", 2)
    return Request(method.upper(), target, b"".join(lines) + b"\r\n", _parse_headers(lines[1:]))


def _read_response_head(reader: BinaryIO) -> tuple[int, bytes, dict[str, str]]:
    lines = _read_lines(reader)
    if not lines:
        raise ConnectionError("the server closed the connection without a response")
    status = int(lines[0].split(b" ", 2)[1])
    return status, b"".join(lines) + b"\r\n", _parse_headers(lines[1:])


def _read_lines(reader: BinaryIO) -> list[bytes]:
    """The header lines (with their CRLF) up to the blank line; [] at a clean EOF."""
    lines: list[bytes] = []
    while True:
        line = reader.readline(CHUNK)
        if not line:
            if lines:
                raise ConnectionError("connection closed inside a message head")
            return lines
        if line in (b"\r\n", b"\n"):
            if lines:
                return lines
            continue  # stray blank lines between messages
        lines.append(line)


def _parse_headers(lines: list[bytes]) -> dict[str, str]:
    headers: dict[str, str] = {}
    for line in lines:
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return headers


def _drop_header(head: bytes, name: bytes) -> bytes:
    kept = [line for line in head.split(b"\r\n") if not line.lower().startswith(name + b":")]
    return b"\r\n".join(kept)


def _has_body(headers: dict[str, str]) -> bool:
    return (
        int(headers.get("content-length", "0") or 0) > 0
        or "chunked" in headers.get("transfer-encoding", "").lower()
    )


def _relay_body(
    reader: BinaryIO,
    out: socket.socket | None,
    headers: dict[str, str],
    *,
    cut_at_half: bool = False,
    until_close: bool = False,
) -> bool:
    """Copy a message body from ``reader`` to ``out`` (None: discard). Returns False
    when it was cut (``cut_at_half`` with a known length) or ended by a close."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        _relay_chunked(reader, out)
        return True
    if "content-length" in headers:
        length = int(headers["content-length"])
        limit = length // 2 if cut_at_half and length else length
        _copy(reader, out, limit)
        return limit == length
    if until_close:  # a response framed by closing the connection
        while data := reader.read1(CHUNK):  # type: ignore[attr-defined]
            if out is not None:
                out.sendall(data)
        return False
    return True


def _relay_chunked(reader: BinaryIO, out: socket.socket | None) -> None:
    while True:
        size_line = reader.readline(CHUNK)
        if not size_line:
            raise ConnectionError("connection closed inside a chunked body")
        _send(out, size_line)
        size = int(size_line.split(b";")[0].strip() or b"0", 16)
        if size == 0:
            while True:  # trailers, then the blank line
                trailer = reader.readline(CHUNK)
                _send(out, trailer)
                if trailer in (b"\r\n", b"\n", b""):
                    return
        _copy(reader, out, size + 2)  # the chunk and its CRLF


def _copy(reader: BinaryIO, out: socket.socket | None, nbytes: int) -> None:
    while nbytes > 0:
        data = reader.read(min(CHUNK, nbytes))
        if not data:
            raise ConnectionError("connection closed inside a body")
        _send(out, data)
        nbytes -= len(data)


def _send(out: socket.socket | None, data: bytes) -> None:
    if out is not None and data:
        out.sendall(data)


def _flip_at(rule: Rule | None, length: int) -> int:
    """The byte of a ``length``-byte body a corrupt rule flips."""
    if rule is None or rule.offset is None:
        return length // 2
    return max(0, min(rule.offset, length - 1))


def _relay_faulty(
    reader: BinaryIO, client: socket.socket, length: int, kind: str, flip: int
) -> bool:
    """Relay a ``length``-byte response body with ``kind``'s fault (``corrupt``: the
    byte at ``flip``); False: close."""
    half = length // 2
    if kind == "corrupt":
        first = reader.read(flip) if flip else b""
        middle = reader.read(1)
        client.sendall(first + bytes(b ^ 0xFF for b in middle))
        _copy(reader, client, length - len(first) - len(middle))
        return True
    _copy(reader, client, half)
    if kind == "reset":
        _abort(client)
    return False  # truncated: the server's rest is dropped with the connection
