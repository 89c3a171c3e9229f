"""Real object-store servers on 127.0.0.1 for the tests, each run in threads of the
test process on a port the OS picks, and stopped by the fixture that started it:

- S3: moto's server mode (an S3 protocol server over HTTP), reached by s3fs with
  storage_options endpoint_url, key and secret;
- GCS: gcp-storage-emulator (the GCS JSON API), reached by gcsfs with endpoint_url and
  token="anon".

Both record every request they answer (the object a GCS upload writes, which its URL
does not name, appended as `&name=`), and which of them the client had given up on
before the answer reached it, and can hold requests until enough of them are in flight
at once, or until the test lets them go, so the tests can count requests and see how
many a client keeps in flight, however busy the machine.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import email
import functools
import http.server
import io
import json
import logging
import os
import re
import socket
import threading
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from typing import Any

# gcsfs otherwise asks a Google control-plane API about every bucket (unreachable
# here: each lookup hangs for a minute). Read when gcsfs is imported, so set first.
os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"

import fsspec  # noqa: E402

# Recognisable, so that tests can assert they never show up anywhere.
TEST_KEY = "AKIAZARRCKPTTESTKEY7"
TEST_SECRET = "zarrckpt-test-SECRET-must-never-be-printed-31415"
# Connections a server's socket queues before it accepts them. A client opens up to its
# concurrency (100 on GCS, 128 on S3) at once; past the queue (socketserver's 5) the
# kernel drops them, and a busy machine's accepting thread falls behind: a dropped
# connection waits out TCP's retransmission backoff (1, 3, 7, 15, 31 s), past the
# client's deadline (20 s), and the request then sent again.
_BACKLOG = 1024


@dataclasses.dataclass
class Call:
    """One request a server received: `abandoned` once its client is found to have
    closed the connection before the answer reached it (gave up on it at its deadline,
    or cancelled it: the client sends it again, or took another answer)."""

    method: str
    target: str
    abandoned: bool = False


def client_gone(connection: socket.socket) -> bool:
    """Whether the client closed `connection` (whose request has been read whole)."""
    try:
        return connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:  # open, nothing sent: waiting for the answer
        return False
    except OSError:  # reset
        return True


class Recorder:
    """The requests a server answered, which of them their client gave up on, and how
    many were in flight at most."""

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self.copies: list[tuple[str, str]] = []  # S3's CopyObject: (source, target path)
        self.bytes_received = 0  # the requests' bodies, in all
        self.peak_in_flight = 0
        self._in_flight = 0
        self._lock = threading.Lock()
        self._stall: Callable[[str, str], bool] | None = None
        self._released = threading.Event()
        self._gather: tuple[int, Callable[[str, str], bool], float] | None = None
        self._gathering = 0
        self._gathered = threading.Event()

    @property
    def requests(self) -> list[tuple[str, str]]:
        """Every request received: (method, path?query)."""
        return [(call.method, call.target) for call in self.calls]

    @property
    def answered(self) -> list[tuple[str, str]]:
        """The requests answered to a client still waiting for the answer."""
        return [(call.method, call.target) for call in self.calls if not call.abandoned]

    @property
    def abandoned(self) -> list[tuple[str, str]]:
        """The requests whose client gave up on them (see `Call`)."""
        return [(call.method, call.target) for call in self.calls if call.abandoned]

    def reset(self) -> None:
        with self._lock:
            self.calls.clear()
            self.copies.clear()
            self.bytes_received = 0
            self.peak_in_flight = 0

    @contextlib.contextmanager
    def request(self, method: str, target: str, nbytes: int = 0) -> Iterator[Call]:
        """Records a request while the server answers it; the server marks the `Call`
        yielded abandoned where its client is gone."""
        gather = self._gather
        held = gather is not None and gather[1](method, target)
        call = Call(method, target)
        with self._lock:
            self.calls.append(call)
            self.bytes_received += nbytes
            self._in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self._in_flight)
            if held:
                self._gathering += 1
                if self._gathering >= gather[0]:
                    self._gathered.set()
        try:
            if held and not self._gathered.wait(gather[2]):
                self._gathered.set()  # never that many at once: let every one go, the test sees the peak
            if self._stall is not None and self._stall(method, target):
                self._released.wait(300)  # unanswered until the test lets go (or gives up)
            yield call
        finally:
            with self._lock:
                self._in_flight -= 1
                if held:
                    self._gathering -= 1

    @contextlib.contextmanager
    def stalled(self, which: Callable[[str, str], bool]) -> Iterator[None]:
        """Leaves the requests `which(method, target)` picks unanswered until the block
        ends: a store that stops answering."""
        self._released.clear()
        self._stall = which
        try:
            yield
        finally:
            self._stall = None
            self._released.set()

    @contextlib.contextmanager
    def gathered(self, count: int, which: Callable[[str, str], bool], timeout_s: float = 60.0) -> Iterator[None]:
        """Holds each request `which(method, target)` picks until `count` of them are in
        flight at once, then answers them all; a client that keeps fewer in flight
        waits `timeout_s` once (then every request goes), and `peak_in_flight` shows it.
        Unlike a delay on each request, nothing depends on how fast the client sends."""
        self._gathered.clear()
        self._gather = (count, which, timeout_s)
        try:
            yield
        finally:
            self._gather = None
            self._gathered.set()


def _copy_precondition_fails(environ: dict[str, Any]) -> bool:
    """S3's preconditions on a CopyObject that moto ignores there: "the target must not
    exist" (If-None-Match: *, which moto keeps on PutObject) and "the source must have
    this ETag" (x-amz-copy-source-if-match)."""
    if environ["REQUEST_METHOD"] != "PUT" or "HTTP_X_AMZ_COPY_SOURCE" not in environ:
        return False
    from moto.s3.models import s3_backends

    def found(path: str) -> Any:
        bucket, _, key = urllib.parse.unquote(path).lstrip("/").partition("/")
        try:
            return s3_backends["123456789012"]["aws"].get_object(bucket, key.partition("?")[0])
        except Exception:  # moto's MissingBucket, MissingKey
            return None

    if environ.get("HTTP_IF_NONE_MATCH") == "*" and found(environ["PATH_INFO"]) is not None:
        return True
    if (etag := environ.get("HTTP_X_AMZ_COPY_SOURCE_IF_MATCH")) is not None:
        source = found(environ["HTTP_X_AMZ_COPY_SOURCE"])
        return source is not None and etag.strip('"') != source.etag.strip('"')
    return False


class S3Server:
    """moto's S3 server."""

    protocol = "s3"

    def __init__(self) -> None:
        from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
        from werkzeug.serving import make_server

        class QuietHandler(MotoRequestHandler):
            def log_request(self, *args: Any, **kwargs: Any) -> None:
                pass

            def connection_dropped(self, error: BaseException, environ: dict[str, Any] | None = None) -> None:
                if environ is not None and "zarrckpt.call" in environ:
                    environ["zarrckpt.call"].abandoned = True

        self.recorder = Recorder()
        app = DomainDispatcherApplication(create_backend_app)

        def recorded(environ: dict[str, Any], start_response: Any) -> Any:
            query = environ.get("QUERY_STRING")
            target = environ["PATH_INFO"] + (f"?{query}" if query else "")
            with self.recorder.request(environ["REQUEST_METHOD"], target,
                                       int(environ.get("CONTENT_LENGTH") or 0)) as call:
                environ["zarrckpt.call"] = call  # marked abandoned where writing the answer fails
                if environ["REQUEST_METHOD"] == "PUT" and "HTTP_X_AMZ_COPY_SOURCE" in environ:
                    self.recorder.copies.append((urllib.parse.unquote(environ["HTTP_X_AMZ_COPY_SOURCE"]),
                                                 environ["PATH_INFO"]))
                if _copy_precondition_fails(environ):
                    start_response("412 Precondition Failed", [("Content-Type", "application/xml")])
                    answer = [b"<Error><Code>PreconditionFailed</Code><Message>At least one of the pre-conditions "
                              b"you specified did not hold</Message></Error>"]
                else:
                    answer = app(environ, start_response)
                # The body has been read: a connection at its end is one the client closed.
                call.abandoned = client_gone(environ["werkzeug.socket"])
                return answer

        self._server = make_server("127.0.0.1", 0, recorded, threaded=True, request_handler=QuietHandler)
        self._server.socket.listen(_BACKLOG)  # werkzeug's 128: below what a client may open at once
        self.endpoint = f"http://127.0.0.1:{self._server.server_port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def options(self, key: str = TEST_KEY, secret: str = TEST_SECRET) -> dict[str, Any]:
        return {"endpoint_url": self.endpoint, "key": key, "secret": secret}

    def new_bucket(self) -> str:
        name = f"zarrckpt-{uuid.uuid4().hex[:16]}"
        fsspec.filesystem("s3", **self.options()).mkdir(name)
        return name

    def new_user(self, statements: list[dict[str, Any]]) -> tuple[str, str]:
        """An IAM user allowed what `statements` allow; returns its key and secret.
        Only enforced inside `enforcing_auth`."""
        import boto3

        iam = boto3.client("iam", endpoint_url=self.endpoint, aws_access_key_id=TEST_KEY,
                           aws_secret_access_key=TEST_SECRET, region_name="us-east-1")
        name = f"user-{uuid.uuid4().hex[:8]}"
        iam.create_user(UserName=name)
        iam.put_user_policy(UserName=name, PolicyName="policy", PolicyDocument=json.dumps(
            {"Version": "2012-10-17", "Statement": statements}))
        created = iam.create_access_key(UserName=name)["AccessKey"]
        return created["AccessKeyId"], created["SecretAccessKey"]

    @contextlib.contextmanager
    def enforcing_auth(self) -> Iterator[None]:
        """Makes the server check every request's credentials and IAM policies."""
        self._moto_api("reset-auth", b"0")
        try:
            yield
        finally:
            self._moto_api("reset-auth", b"inf")

    def _moto_api(self, name: str, body: bytes) -> None:
        request = urllib.request.Request(f"{self.endpoint}/moto-api/{name}", data=body, method="POST",
                                         headers={"Content-Type": "text/plain"})
        with urllib.request.urlopen(request, timeout=10) as response:
            response.read()

    @staticmethod
    def kind(method: str, target: str) -> str:
        """What a request does: read, write, list, delete or other."""
        path, _, query = target.partition("?")
        is_object = path.strip("/").count("/") >= 1
        if method == "GET":
            return "read" if is_object else ("list" if "list-type" in query else "other")
        return {"PUT": "write" if is_object else "other", "DELETE": "delete"}.get(method, "other")

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


class GCSServer:
    """gcp-storage-emulator's GCS JSON API, its data in memory.

    The emulator's own server answers one request at a time; here a threading server
    accepts requests concurrently (so delays overlap, as on a real store), and a lock
    keeps its storage, which is not thread-safe, to one request at a time.
    """

    protocol = "gs"

    def __init__(self) -> None:
        from gcp_storage_emulator import server as emulator
        from gcp_storage_emulator.server import RequestHandler
        from gcp_storage_emulator.storage import Storage

        _parse_uploads_exactly(emulator)
        # It logs every 404 as an error; absent objects are routine here.
        logging.getLogger("gcp_storage_emulator").setLevel(logging.CRITICAL)

        class MemoryStorage(Storage):
            def _write_config_to_file(self) -> None:
                # Persists the whole object table on every change: quadratic, and
                # pointless for data kept in memory.
                pass

        recorder = self.recorder = Recorder()
        storage_lock = threading.Lock()

        class Handler(RequestHandler):
            def _serve(self, method: str) -> None:
                target = self._target(method)
                with recorder.request(method, target, int(self.headers.get("Content-Length") or 0)) as call, \
                        storage_lock:
                    # An upload's body has been read (`_target`), a download has none.
                    call.abandoned = client_gone(self.connection)
                    try:
                        self._answer(method, target)
                    except (BrokenPipeError, ConnectionResetError):
                        call.abandoned = True
                        self.close_connection = True

            def _answer(self, method: str, target: str) -> None:
                if self._precondition_fails(method, target):
                    body = json.dumps({"error": {"code": 412, "message": "conditionNotMet",
                                                 "errors": [{"reason": "conditionNotMet"}]}}).encode()
                    self.send_response(412)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                getattr(RequestHandler, f"do_{method}")(self)

            def _precondition_fails(self, method: str, target: str) -> bool:
                """GCS's preconditions that the emulator ignores: "must not exist" on an
                upload or a rewrite (ifGenerationMatch=0, what gcsfs sends for
                mode="create"), and on a rewrite "the source must be this generation"
                (ifSourceGenerationMatch)."""
                path, _, query = target.partition("?")
                fields = urllib.parse.parse_qs(query)
                rewrite = re.search(r"/b/([^/]+)/o/([^/?]+)/rewriteTo/b/([^/]+)/o/([^?]+)$", path)
                if method != "POST" or ("name" not in fields and rewrite is None):
                    return False

                def generation(bucket: str, name: str) -> str | None:
                    try:
                        return str(self.storage.get_file_obj(bucket, urllib.parse.unquote(name))["generation"])
                    except Exception:  # the emulator's NotFound
                        return None

                if rewrite is not None:
                    source, (bucket, name) = rewrite.group(1, 2), rewrite.group(3, 4)
                    wanted = fields.get("ifSourceGenerationMatch")
                    if wanted is not None and generation(*source) not in (None, wanted[-1]):
                        return True
                else:
                    bucket, name = path.split("/b/", 1)[1].split("/", 1)[0], fields["name"][-1]
                return fields.get("ifGenerationMatch") == ["0"] and generation(bucket, name) is not None

            def _target(self, method: str) -> str:
                """The path, and for an upload the object it writes (named in its body)."""
                length = self.headers.get("Content-Length")
                if method != "POST" or not self.path.startswith("/upload/") or not length:
                    return self.path
                body = self.rfile.read(int(length))
                self.rfile = io.BytesIO(body)  # read again by the emulator
                name = re.search(rb'"name":\s*"([^"]*)"', body)
                return self.path if name is None else f"{self.path}&name={name.group(1).decode()}"

            def do_GET(self) -> None:
                self._serve("GET")

            def do_POST(self) -> None:
                self._serve("POST")

            def do_PUT(self) -> None:
                self._serve("PUT")

            def do_PATCH(self) -> None:
                self._serve("PATCH")

            def do_DELETE(self) -> None:
                self._serve("DELETE")

            def log_message(self, *args: Any) -> None:
                pass

        server_class = type("Server", (http.server.ThreadingHTTPServer,),
                            {"daemon_threads": True, "request_queue_size": _BACKLOG})
        self._server = server_class(("127.0.0.1", 0), functools.partial(Handler, MemoryStorage(use_memory_fs=True)))
        self.endpoint = f"http://127.0.0.1:{self._server.server_port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def options(self) -> dict[str, Any]:
        return {"endpoint_url": self.endpoint, "token": "anon"}

    def new_bucket(self) -> str:
        name = f"zarrckpt-{uuid.uuid4().hex[:16]}"
        fsspec.filesystem("gs", **self.options()).mkdir(name)
        return name

    @staticmethod
    def kind(method: str, target: str) -> str:
        """What a request does: read, write, list, delete or other."""
        path = target.partition("?")[0]
        if method == "GET":
            if path.startswith("/download/"):
                return "read"
            return "list" if path.endswith("/o") else "other"
        if method == "POST" and path.startswith("/upload/"):
            return "write"
        return "delete" if method == "DELETE" else "other"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


def _parse_uploads_exactly(emulator: Any) -> None:
    """Replaces the emulator's reading of multipart uploads (the kind gcsfs sends for
    objects under 50 MiB) with a byte-exact one.

    The emulator parses them with the `email` package, which takes a trailing b"\r"
    of the object for part of the line break before the closing boundary: about one
    random chunk in 256 came back a byte short. Real GCS stores the bytes as sent.
    """
    original = emulator._read_data
    if getattr(original, "exact_uploads", False):
        return

    def read_data(handler: Any, query: dict[str, list[str]]) -> Any:
        content_type = handler.headers.get("Content-Type") or ""
        if not content_type.startswith("multipart/related"):
            return original(handler, query)
        raw = emulator._decode_raw_data(emulator._read_raw_data(handler), handler)
        boundary = b"--" + re.search(r'boundary="?([^";]+)"?', content_type).group(1).encode()
        # A part ends with the line break before the next boundary: CRLF or LF, as
        # the sender chose for the whole body. Only the last boundary closes it.
        newline = b"\r\n" if raw.startswith(boundary + b"\r\n") else b"\n"
        body = raw[len(boundary + newline): raw.rindex(newline + boundary + b"--")]
        meta_part, content_part = body.split(newline + boundary + newline, 1)
        content_headers, content = content_part.split(newline * 2, 1)
        return {
            "meta": json.loads(meta_part.split(newline * 2, 1)[1]),
            "content": content,
            "content-type": email.message_from_bytes(content_headers + newline * 2).get_content_type(),
        }

    read_data.exact_uploads = True  # type: ignore[attr-defined]
    emulator._read_data = read_data


def request_kinds(server: S3Server | GCSServer) -> collections.Counter[str]:
    """How many requests of each kind the server has answered since its last reset to a
    client that waited for the answer: one the client gave up on (`Call`) is left out,
    its resend counts. Those of an earlier call that reach the server late are too."""
    return collections.Counter(server.kind(method, target) for method, target in server.recorder.answered)
