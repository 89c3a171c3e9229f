"""Progress bars for long saves and restores: tqdm, on process 0, when wanted."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator

from . import _multihost

_SHOW_AFTER_S = 2.0  # short saves and restores stay silent


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

    with tqdm(total=total_bytes, desc=what, unit="B", unit_scale=True, delay=_SHOW_AFTER_S,
              leave=False, file=sys.stderr) as progress:
        yield progress.update
