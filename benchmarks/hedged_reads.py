"""Restores from an object store that answers a few GETs very late: hedged reads
against waiting them out.

    python benchmarks/hedged_reads.py                      # 32 MiB, 2% of GETs 10 s late, 5 rounds
    python benchmarks/hedged_reads.py --size-mib 64 --late-share 0.05 --late-s 5

moto's S3 server on loopback, behind the tests' fault proxy (tests/fault_proxy.py),
which holds the first GET of --late-share of the chunks for --late-s seconds (chosen
afresh each round) before answering. The checkpoint is --size-mib of float32 leaves in
--chunk-kib chunks. Each round restores it three ways, in turn, through one client (so
that what it learnt of the store's reads carries from round to round, as a manager's
restores' does):
  - no late GETs, hedging on (zarrckpt as it is);
  - no late GETs, hedging off (no second request earned: what zarrckpt did before);
  - late GETs, hedging on;
  - late GETs, hedging off (--rounds-off of them: each waits out a late GET).
Figures: worst and median of the rounds, and the chunk GETs the store had beyond one per
chunk. Targets (issue 37): late GETs hedged, worst round <= 1.3x the worst round with no
late GETs, with <= 5% extra GETs; with no late GETs, hedging on within noise of off.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
sys.path.insert(0, os.path.dirname(HERE))

import numpy as np  # noqa: E402
from fault_proxy import Delay, FaultProxy  # noqa: E402
from object_store_servers import S3Server  # noqa: E402

import zarrckpt  # noqa: E402
from zarrckpt._storage import hedge  # noqa: E402

TARGET_RATIO = 1.3
TARGET_EXTRA = 0.05


class LateGets:
    """The proxy's fault: the first GET of a chosen share of chunks, held; every chunk
    GET counted."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.late: set[str] = set()
        self.seconds = 0.0
        self.gets: list[str] = []

    def start(self, chunks: list[str], share: float, seconds: float, rng: random.Random) -> None:
        with self._lock:
            self.late = set(rng.sample(chunks, max(1, round(share * len(chunks))))) if share else set()
            self.seconds, self.gets = seconds, []

    def __call__(self, kind: str, method: str, target: str, body: bytes):
        if kind != "read" or "/c." not in target:
            return None
        with self._lock:
            self.gets.append(target)
            key = target.split("?")[0].split("/", 2)[-1]
            late = key in self.late and self.gets.count(target) == 1
        return Delay(self.seconds) if late else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=float, default=32.0, help="the checkpoint's size (default 32)")
    parser.add_argument("--chunk-kib", type=int, default=256, help="its chunks' size (default 256)")
    parser.add_argument("--late-share", type=float, default=0.02, help="chunks whose first GET is late (default 0.02)")
    parser.add_argument("--late-s", type=float, default=10.0, help="how late (default 10 s)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds, after one (default 5)")
    parser.add_argument("--rounds-off", type=int, default=2, help="of them, late GETs waited out (default 2)")
    args = parser.parse_args()

    server = S3Server()
    proxy = FaultProxy(server.endpoint, "s3")
    fault = LateGets()
    proxy.fault = fault
    try:
        bucket = server.new_bucket()
        url = f"s3://{bucket}/ckpt"
        per_chunk = args.chunk_kib * 2**10 // 4
        leaves = max(1, int(args.size_mib * 2**20 // (per_chunk * 4)))
        tree = {f"l{i:04d}": np.full(per_chunk, i, np.float32) for i in range(leaves)}
        zarrckpt.save_pytree(url, tree, storage_options=server.options())
        chunks = [f"ckpt/{name}/c.0" for name in tree]
        options = {**server.options(), "endpoint_url": proxy.endpoint}
        rng = random.Random(0)
        share, burst = hedge.SHARE, hedge._BURST
        runs: dict[str, list[tuple[float, int]]] = {"calm, hedging on": [], "calm, hedging off": [],
                                                    "late GETs, hedging on": [], "late GETs, hedging off": []}
        for round_ in range(args.rounds + 1):  # the first warms up (imports, connections, the read history)
            for name in runs:
                if name.endswith("off") and name.startswith("late") and round_ > args.rounds_off:
                    continue
                hedge.SHARE, hedge._BURST = (share, burst) if name.endswith("on") else (0.0, 0.0)
                fault.start(chunks, args.late_share if name.startswith("late") else 0.0, args.late_s, rng)
                started = time.perf_counter()
                back = zarrckpt.load_pytree(url, storage_options=options)
                seconds = time.perf_counter() - started
                assert all(np.array_equal(back[k], v) for k, v in tree.items())
                if round_:
                    runs[name].append((seconds, len(fault.gets) - len(chunks)))
        hedge.SHARE, hedge._BURST = share, burst
        print(f"{leaves} chunks of {args.chunk_kib} KiB ({leaves * args.chunk_kib / 1024:.0f} MiB), moto on loopback; "
              f"late: the first GET of {args.late_share:.0%} of the chunks, by {args.late_s:g} s")
        print(f"  {'':24} {'worst s':>8} {'median s':>9} {'extra GETs (max)':>17}")
        for name, values in runs.items():
            seconds = [s for s, _ in values]
            print(f"  {name:24} {max(seconds):8.3f} {statistics.median(seconds):9.3f} "
                  f"{max(e for _, e in values):8d} ({max(e for _, e in values) / leaves:.1%})")
        calm = max(s for s, _ in runs["calm, hedging on"])
        late = max(s for s, _ in runs["late GETs, hedging on"])
        extra = max(e for _, e in runs["late GETs, hedging on"]) / leaves
        off = statistics.median(s for s, _ in runs["calm, hedging off"])
        on = statistics.median(s for s, _ in runs["calm, hedging on"])
        print(f"\nlate GETs, hedged: worst round {late / calm:.2f}x the worst calm round (target <= {TARGET_RATIO}), "
              f"extra GETs {extra:.1%} (target <= {TARGET_EXTRA:.0%}); calm, hedging on / off (medians): "
              f"{on / off:.3f}")
    finally:
        proxy.stop()
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
