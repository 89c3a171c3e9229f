"""How long saves and restores are shown to people: progress bars (tqdm, on process 0,
when wanted), and byte counts in binary units for the log and the command line."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator

from . import multihost as _multihost

_SHOW_AFTER_S = 2.0  # short saves and restores stay silent
_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def size(nbytes: int | float) -> str:
    """A byte count for people, as the command line and the log show them: 512 B,
    1.5 KiB, 3.2 GiB."""
    value, power = float(nbytes), 0
    while value >= 1024 and power < len(_UNITS) - 1:
        value, power = value / 1024, power + 1
    return f"{int(nbytes)} B" if power == 0 else f"{value:.1f} {_UNITS[power]}"


def rate(nbytes: int | float, seconds: float) -> str:
    """`nbytes` in `seconds`, for the log: 1.2 GiB in 0.84s (1.4 GiB/s)."""
    return f"{size(nbytes)} in {seconds:.2f}s ({size(nbytes / max(seconds, 1e-9))}/s)"


@contextlib.contextmanager
def bar(what: str, total_bytes: int, enabled: bool | None) -> Iterator[Callable[[int], None]]:
    """Yields a function to call with each finished piece's byte count.

    `enabled` None means: when stderr is a terminal. Only process 0 ever shows one.
    """
    show = sys.stderr.isatty() if enabled is None else enabled
    if not show or _multihost.process_index() != 0:
        yield lambda nbytes: None
        return
    from tqdm.auto import tqdm

    # Binary units, as `size` writes them ("iB" after tqdm's k/M/G prefix: 2.00GiB).
    with tqdm(total=total_bytes, desc=what, unit="iB", unit_scale=True, unit_divisor=1024, delay=_SHOW_AFTER_S,
              leave=False, file=sys.stderr) as progress:
        yield progress.update
