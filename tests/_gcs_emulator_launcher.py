"""Run gcp-storage-emulator in memory on one loopback port, with a deep listen backlog.

Usage: ``python tests/_gcs_emulator_launcher.py PORT``

The emulator serves from one thread with ``http.server.HTTPServer``, whose listen
backlog is 5: a client with more requests in flight than that (cloudckpt keeps up
to 16) gets connection resets. This launcher raises the backlog before the server
binds, then runs the emulator in this process until SIGTERM/SIGINT. It only ever
binds 127.0.0.1.

It also replaces the emulator's parsing of ``multipart/related`` uploads: the emulator
feeds them to the ``email`` parser, which drops a trailing ``\r`` of the object's bytes
when the client (gcsfs) separates parts with bare ``\n``, so about one binary object
in 256 came back one byte short. The replacement is binary-safe and follows the line
ending the client used.
"""

from __future__ import annotations

import base64
import http.server
import json
import logging
import os
import signal
import sys
import threading
from typing import Any

from gcp_storage_emulator import server as emulator_server

LISTEN_BACKLOG = 1024
HOST = "127.0.0.1"


def _boundary(content_type: str) -> bytes:
    for param in content_type.split(";")[1:]:
        name, _, value = param.strip().partition("=")
        if name.lower() == "boundary":
            return value.strip().strip('"').encode()
    raise ValueError(f"multipart upload without a boundary: {content_type!r}")


def _split_part(part: bytes, eol: bytes) -> tuple[dict[str, str], bytes]:
    head, _, body = part.partition(eol + eol)
    headers = {}
    for line in head.split(eol):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return headers, body


def parse_multipart_related(raw: bytes, content_type: str) -> dict[str, Any]:
    """``{"meta", "content", "content-type"}`` of a JSON-API multipart upload, byte-exact."""
    delimiter = b"--" + _boundary(content_type)
    start = raw.index(delimiter) + len(delimiter)
    eol = b"\r\n" if raw.startswith(b"\r\n", start) else b"\n"
    separator = eol + delimiter
    end = raw.rindex(separator + b"--")
    meta_part, _, media_part = raw[start + len(eol) : end].partition(separator + eol)
    _, meta = _split_part(meta_part, eol)
    headers, content = _split_part(media_part, eol)
    if headers.get("content-transfer-encoding", "").lower() == "base64":
        content = base64.b64decode(content)
    return {
        "meta": json.loads(meta),
        "content": content,
        "content-type": headers.get("content-type", "application/octet-stream"),
    }


def _patch_multipart_parsing() -> None:
    original = emulator_server._read_data

    def read_data(request_handler: Any, query: dict[str, Any]) -> Any:
        content_type = request_handler.headers.get("Content-Type") or ""
        if not content_type.startswith("multipart/related"):
            return original(request_handler, query)
        raw = emulator_server._decode_raw_data(
            emulator_server._read_raw_data(request_handler), request_handler
        )
        return parse_multipart_related(raw, content_type) if raw else None

    emulator_server._read_data = read_data


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: _gcs_emulator_launcher.py PORT", file=sys.stderr)
        return 2
    port = int(argv[0])
    # Must be set before the emulator creates its HTTPServer (a class attribute read in
    # server_activate()).
    http.server.HTTPServer.request_queue_size = LISTEN_BACKLOG
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    _patch_multipart_parsing()
    server = emulator_server.create_server(HOST, port, in_memory=True)

    # A failure to bind happens in the emulator's server thread; without this hook the
    # main thread would wait forever for a server that never started.
    def _die(args: threading.ExceptHookArgs) -> None:
        print(f"gcs emulator thread failed: {args.exc_value!r}", file=sys.stderr, flush=True)
        os._exit(3)

    threading.excepthook = _die
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    server.start()
    print(f"gcs emulator listening on http://{HOST}:{port}", file=sys.stderr, flush=True)
    try:
        while not stop.wait(0.2):
            pass
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
