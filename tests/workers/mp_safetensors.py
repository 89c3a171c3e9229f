"""Multi-process safetensors worker: restores FILE onto a mesh of every process's
devices, each tensor's rows cut over all of them, and reports how many bytes this
process read and how many shards it checked against the file's values.

    FILE    a .safetensors file every process can read
"""

from __future__ import annotations

from common import init, report

(path,) = init()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import safetensors.numpy  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import zarrckpt  # noqa: E402
from zarrckpt._util import stats as _stats  # noqa: E402

want = safetensors.numpy.load_file(path)
rows = NamedSharding(Mesh(np.array(jax.devices()), ("fsdp",)), P("fsdp"))
target = {name.split(".")[0]: {name.split(".")[1]: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rows)}
          for name, x in want.items()}
_stats.reset()
back = zarrckpt.load_safetensors(path, target)
read = _stats.snapshot()["store_bytes_read"]
checked = 0
for name, x in want.items():
    got = back[name.split(".")[0]][name.split(".")[1]]
    for shard in got.addressable_shards:
        if not np.array_equal(np.asarray(shard.data).view(np.uint8), x[shard.index].view(np.uint8)):
            raise AssertionError(f"{name} {shard.index} differs from the file")
        checked += 1
report(read=read, checked=checked)
