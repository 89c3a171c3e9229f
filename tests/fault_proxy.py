"""A fault-injecting HTTP proxy on 127.0.0.1, in front of a real store server (moto's S3
or the GCS emulator, tests/object_store_servers.py): the client talks to the proxy as
it would to the store, and the proxy forwards each request, or answers it as a store
that misbehaves would.

`proxy.fault` decides, for each request, given its kind (read, ranged, check, list,
write, delete, other: `kind_of`), method, target and body, what happens to it: None passes it
on; `Answer(status)` answers with that error, spelled as the store spells it (S3's
`<Error><Code>SlowDown</Code>` XML, GCS's JSON `error` with its reason), without
forwarding; `RESET` drops the connection without an answer; `Late(seconds)` holds the
request, answers nothing, and forwards it after `seconds` (or at `settle()`, if that
comes first), long after the client gave up on it, as a store that applies a request
late does; `Delay(seconds)` forwards it
after `seconds` and answers (a slow store); `Garbled(keep_checksums)` forwards it and
answers with one bit of the store's answer flipped (damage on the way), with the store's
checksum headers of the answer (S3's x-amz-checksum-*, GCS's x-goog-hash), which the
client checks, or without them, as a store that sends none.

With `ignores_conditions`, every request is forwarded without its conditions, as a
server that speaks the store's API without conditional writes (S3 itself before 2024)
treats it: S3's If-None-Match and x-amz-copy-source-if-*, GCS's ifGenerationMatch and
ifSourceGenerationMatch are dropped, and a CopyObject is answered with the ETag its
x-amz-copy-source-if-match named (the source's old one) whatever it copied.
"""

from __future__ import annotations

import dataclasses
import http.client
import http.server
import json
import random
import re
import socket
import struct
import threading
import time
import urllib.parse
from collections.abc import Callable
from typing import Any

# The error each status is answered with: S3's code, GCS's reason.
_S3_CODES = {500: "InternalError", 503: "SlowDown", 429: "SlowDown", 412: "PreconditionFailed", 416: "InvalidRange"}
_GCS_REASONS = {500: "backendError", 503: "backendError", 429: "rateLimitExceeded", 412: "conditionNotMet",
                416: "requestedRangeNotSatisfiable"}
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "expect",
               "proxy-connection", "content-length"}


@dataclasses.dataclass(frozen=True)
class Answer:
    status: int


@dataclasses.dataclass(frozen=True)
class Late:
    seconds: float


@dataclasses.dataclass(frozen=True)
class Delay:
    seconds: float


@dataclasses.dataclass(frozen=True)
class Garbled:
    keep_checksums: bool = True


RESET = "reset"
Fault = Answer | Late | Delay | Garbled | str | None


def kind_of(protocol: str, method: str, target: str, headers: Any) -> str:
    """What a request does, on S3 or GCS: read, ranged (a read of a byte range), check
    (a HEAD, or GCS's object metadata), list, write, copy, delete or other."""
    path, _, query = target.partition("?")
    if protocol == "s3":
        is_object = path.strip("/").count("/") >= 1
        if method == "HEAD":
            return "check"
        if method == "GET":
            if is_object:
                return "ranged" if headers.get("Range") else "read"
            return "list" if "list-type" in query or "prefix" in query else "other"
        if method == "PUT" and is_object:
            return "copy" if headers.get("x-amz-copy-source") else "write"
        if method == "DELETE" or (method == "POST" and "delete" in query):
            return "delete"
        return "other"
    if method == "GET":
        if path.startswith("/download/") or "alt=media" in query:
            return "ranged" if headers.get("Range") else "read"
        return "list" if path.endswith("/o") else "check"
    if method in ("POST", "PUT") and path.startswith("/upload/"):
        return "write"
    if method == "POST" and ("/rewriteTo/" in path or "/copyTo/" in path):
        return "copy"
    return "delete" if method == "DELETE" else "other"


def _unconditional(target: str, headers: dict[str, str]) -> tuple[str, dict[str, str], str | None]:
    """The request `target` and `headers` without the conditions of S3 and GCS (see the
    module's docstring), and the ETag an S3 copy's x-amz-copy-source-if-match named."""
    named = next((value for name, value in headers.items() if name.lower() == "x-amz-copy-source-if-match"), None)
    kept = {name: value for name, value in headers.items()
            if name.lower() != "if-none-match" and not name.lower().startswith("x-amz-copy-source-if-")}
    path, _, query = target.partition("?")
    fields = urllib.parse.parse_qsl(query, keep_blank_values=True)
    kept_fields = [(k, v) for k, v in fields if k not in ("ifGenerationMatch", "ifSourceGenerationMatch")]
    if len(kept_fields) < len(fields):  # else the query as it came: the store's decoding of it untouched
        target = f"{path}?{urllib.parse.urlencode(kept_fields)}" if kept_fields else path
    return target, kept, named


class FaultProxy:
    """A proxy in front of the store server at `upstream` ("http://127.0.0.1:PORT"),
    speaking as `protocol` ("s3" or "gs") when it answers for it. `injected` counts the
    faults it made, by kind of request, `seen` the requests it had."""

    def __init__(self, upstream: str, protocol: str) -> None:
        self.protocol = protocol
        self.fault: Callable[[str, str, str, bytes], Fault] | None = None
        self.ignores_conditions = False
        self.injected: dict[str, int] = {}
        self.seen: dict[str, int] = {}
        self._lock = threading.Lock()
        self._late: list[tuple[threading.Thread, threading.Event]] = []
        self._stopping = threading.Event()
        self._handling = threading.Condition()
        self._handlers = 0  # requests in the proxy now
        parts = urllib.parse.urlsplit(upstream)
        self._upstream = (parts.hostname, parts.port)
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _handle(self) -> None:
                with proxy._handling:
                    # A request read after `stop` began (its connection accepted, its
                    # headers still arriving) is a finished test's: never forwarded.
                    if proxy._stopping.is_set():
                        self.close_connection = True
                        return
                    proxy._handlers += 1
                try:
                    self._handle_one()
                finally:
                    with proxy._handling:
                        proxy._handlers -= 1
                        proxy._handling.notify_all()

            def _handle_one(self) -> None:
                body = self._body()
                kind = kind_of(proxy.protocol, self.command, self.path, self.headers)
                target, sent, named = self.path, dict(self.headers.items()), None
                if proxy.ignores_conditions:
                    target, sent, named = _unconditional(target, sent)
                fault = proxy.fault(kind, self.command, self.path, body) if proxy.fault is not None else None
                with proxy._lock:
                    proxy.seen[kind] = proxy.seen.get(kind, 0) + 1
                    if fault is not None:
                        proxy.injected[kind] = proxy.injected.get(kind, 0) + 1
                if isinstance(fault, Delay):
                    time.sleep(fault.seconds)
                if fault == RESET:
                    # RST, not FIN: the client sees a connection reset mid-request.
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    self.close_connection = True
                    return
                if isinstance(fault, Answer):
                    self._answer(fault.status)
                    return
                if isinstance(fault, Late):
                    land = threading.Event()
                    late = threading.Thread(target=proxy._forward_late, daemon=True,
                                            args=(land, fault.seconds, self.command, target, sent, body))
                    with proxy._lock:
                        proxy._late.append((late, land))
                    late.start()
                    # Nothing is answered, whenever the request lands: the client waits until
                    # its deadline, and gives up.
                    self.close_connection = True
                    proxy._stopping.wait(fault.seconds + 60)
                    return
                status, headers, answer = proxy._send(self.command, target, sent, body)
                if named is not None and kind == "copy" and status == 200:
                    answer = re.sub(rb"<ETag>[^<]*</ETag>", b"<ETag>" + named.encode() + b"</ETag>", answer)
                if isinstance(fault, Garbled) and answer:
                    answer = answer[:len(answer) // 2] + bytes([answer[len(answer) // 2] ^ 0x01]) + \
                        answer[len(answer) // 2 + 1:]
                    if not fault.keep_checksums:
                        headers = [(name, value) for name, value in headers
                                   if not name.lower().startswith(("x-amz-checksum", "x-goog-hash"))]
                self.send_response(status)
                for name, value in headers:
                    if name.lower() not in _HOP_BY_HOP:
                        self.send_header(name, value)
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(answer)

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    data = b""
                    while size := int(self.rfile.readline().split(b";")[0], 16):
                        data += self.rfile.read(size)
                        self.rfile.readline()
                    self.rfile.readline()
                    return data
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _answer(self, status: int) -> None:
                if proxy.protocol == "s3":
                    code = _S3_CODES.get(status, "InternalError")
                    body = (f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code><Message>injected "
                            f"{status}</Message><RequestId>1</RequestId></Error>").encode()
                    kind = "application/xml"
                else:
                    reason = _GCS_REASONS.get(status, "backendError")
                    body = json.dumps({"error": {"code": status, "message": f"injected {status}",
                                                 "errors": [{"reason": reason, "message": "injected"}]}}).encode()
                    kind = "application/json"
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        for method in ("GET", "HEAD", "PUT", "POST", "DELETE", "PATCH"):
            setattr(Handler, f"do_{method}", Handler._handle)
        server_class = type("Server", (http.server.ThreadingHTTPServer,), {"daemon_threads": True})
        self._server = server_class(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def at_random(self, share: float, make: Callable[[random.Random], Fault], seed: int = 0,
                  kinds: frozenset[str] | None = None) -> None:
        """Faults on `share` of the requests (of `kinds`, or all), each made by `make`."""
        rng = random.Random(seed)
        lock = threading.Lock()

        def fault(kind: str, method: str, target: str, body: bytes) -> Fault:
            with lock:
                hit = rng.random() < share and (kinds is None or kind in kinds)
                return make(rng) if hit else None

        self.fault = fault

    def once(self, make: Fault, which: Callable[[str, str, bytes], bool], times: int = 1) -> None:
        """The fault `make` on the first `times` requests that `which(kind, target,
        body)` picks; every other request passes."""
        left = [times]
        lock = threading.Lock()

        def fault(kind: str, method: str, target: str, body: bytes) -> Fault:
            with lock:
                if left[0] and which(kind, target, body):
                    left[0] -= 1
                    return make
            return None

        self.fault = fault

    def settle(self, timeout_s: float = 60.0) -> None:
        """Forwards every late request held so far now, and waits until each has been
        answered."""
        with self._lock:
            late, self._late = self._late, []
        for thread, land in late:
            land.set()
            thread.join(timeout_s)

    def _forward_late(self, land: threading.Event, seconds: float, method: str, target: str,
                      headers: dict[str, str], body: bytes) -> None:
        land.wait(seconds)
        self._send(method, target, headers, body)

    def _send(self, method: str, target: str, headers: dict[str, str],
              body: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
        connection = http.client.HTTPConnection(*self._upstream, timeout=120)
        try:
            sent = {k: v for k, v in headers.items() if k.lower() not in _HOP_BY_HOP}
            connection.request(method, target, body=body if body or method in ("PUT", "POST") else None,
                               headers=sent)
            response = connection.getresponse()
            return response.status, response.getheaders(), response.read()
        finally:
            connection.close()

    def stop(self) -> None:
        self.fault = None
        self.settle()
        self._stopping.set()
        # A request still in the proxy (delayed, or being forwarded) that its client gave
        # up on would land on the server during the next test, which counted 5 writes
        # where it expected reads only: stopping waits for each (an idle keep-alive
        # connection is no request).
        with self._handling:
            self._handling.wait_for(lambda: self._handlers == 0, timeout=180)
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
