"""Shared fixtures. JAX gets 8 CPU devices in the test process, set before it is imported.

`store` gives a fresh, empty checkpoint URL (and its storage options) on each kind of
store: a local path, file://, memory://, and real S3 and GCS servers on 127.0.0.1
(tests/object_store_servers.py), started on first use and stopped at the end.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import dataclasses  # noqa: E402
import shutil  # noqa: E402
import socket  # noqa: E402
import stat  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import uuid  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import fsspec  # noqa: E402
import pytest  # noqa: E402
from object_store_servers import GCSServer, S3Server  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_read_history(monkeypatch):
    """Every test's store clients start with no history of reads (zarrckpt._storage.hedge),
    as a new job's do: how long one test's reads took never decides another's second
    requests, nor do second requests it earned carry over."""
    from zarrckpt._storage import hedge

    monkeypatch.setattr(hedge, "_CLIENTS", hedge.weakref.WeakKeyDictionary())


STORES = ["local", "file", "memory", "s3", "gcs"]
OBJECT_STORES = ["s3", "gcs"]


@dataclasses.dataclass(frozen=True)
class Store:
    """A checkpoint URL and the storage_options to reach it (None where none are needed)."""

    kind: str
    url: str
    options: dict[str, Any] | None = None
    server: S3Server | GCSServer | None = None


@pytest.fixture
def small_disk(tmp_path):
    """A real 3 MiB filesystem (tmpfs), to fill."""
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount_point)],
                             capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a 3 MiB tmpfs here: {mounted.stderr.decode().strip()}")
    yield mount_point
    subprocess.run(["umount", "-l", str(mount_point)], check=False)


@pytest.fixture(scope="session")
def s3_server():
    server = S3Server()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def gcs_server():
    server = GCSServer()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def new_store(request, tmp_path_factory):
    """Makes a fresh place on a store of the kind asked for (a new bucket on the
    object stores), for fixtures of any scope."""
    def make(kind: str) -> Store:
        if kind == "local":
            return Store(kind, str(tmp_path_factory.mktemp("local") / "ckpt"))
        if kind == "file":
            return Store(kind, f"file://{tmp_path_factory.mktemp('file')}/ckpt")
        if kind == "memory":
            return Store(kind, f"memory://zarrckpt-tests/{uuid.uuid4().hex}")
        if kind in OBJECT_STORES:
            server = request.getfixturevalue(f"{kind}_server")
            return Store(kind, f"{server.protocol}://{server.new_bucket()}/ckpt", server.options(), server)
        raise ValueError(kind)

    return make


@pytest.fixture(params=STORES)
def store(request, new_store):
    """A fresh, empty checkpoint URL on each kind of store; memory:// is cleaned up afterwards."""
    made = new_store(request.param)
    yield made
    if made.kind == "memory":
        fs = fsspec.filesystem("memory")
        if fs.exists(made.url):
            fs.rm(made.url, recursive=True)


@pytest.fixture
def special_file():
    """Makes a path a FIFO, a listening Unix socket or a device file (/dev/zero's);
    closes the sockets at the end."""
    sockets = []

    def make(path: Path, kind: str) -> None:
        if path.exists():
            path.unlink()
        if kind == "fifo":
            os.mkfifo(path)
        elif kind == "socket":  # bound where its path is short enough for AF_UNIX, then linked into place
            short = Path(tempfile.mkdtemp(prefix="zs")) / "s"
            sock = socket.socket(socket.AF_UNIX)
            sock.bind(str(short))
            sock.listen()
            sockets.append((sock, short))
            try:
                os.link(short, path)
            except OSError as e:  # the temporary directory on another file system than the test's
                pytest.skip(f"cannot link a socket into {path.parent}: {e}")
        else:
            try:
                os.mknod(path, 0o644 | stat.S_IFCHR, os.makedev(1, 5))
            except PermissionError:
                pytest.skip("making a device file needs root")

    yield make
    for sock, short in sockets:
        sock.close()
        shutil.rmtree(short.parent)
