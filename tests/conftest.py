"""Shared fixtures. JAX gets 8 CPU devices in the test process, set before it is imported."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import uuid  # noqa: E402

import fsspec  # noqa: E402
import pytest  # noqa: E402

STORES = ["local", "file", "memory"]


def make_url(kind: str, tmp_path) -> str:
    if kind == "local":
        return str(tmp_path / "ckpt")
    if kind == "file":
        return f"file://{tmp_path}/ckpt"
    if kind == "memory":
        return f"memory://zarrckpt-tests/{uuid.uuid4().hex}"
    raise ValueError(kind)


@pytest.fixture(params=STORES)
def store_url(request, tmp_path):
    """A fresh, empty URL on each kind of store; memory:// is cleaned up afterwards."""
    url = make_url(request.param, tmp_path)
    yield url
    if url.startswith("memory://"):
        fs = fsspec.filesystem("memory")
        if fs.exists(url):
            fs.rm(url, recursive=True)
