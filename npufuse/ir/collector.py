"""Python's cyclic garbage collector, run less often while a big model is worked on."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

# A gen-0 pass every this many new container objects, where Python's default is 700.
_YOUNG_THRESHOLD = 100_000

_lock = threading.Lock()
_depth = 0                                  # blocks open now, in any thread
_saved: tuple[int, ...] | None = None       # the thresholds before the outermost one


@contextmanager
def fewer_collections() -> Iterator[None]:
    """Collect cycles less often inside the block (usable as a decorator too). Indexing and rewriting a
    100k-node graph makes millions of small containers and almost no cycles; with the default thresholds the
    collector walks them all some dozen times, about a tenth of the run (and a full pass over the results when
    the model is written). The thresholds are process-wide: the first block to open raises them, the last to
    close restores them, nested or in several threads."""
    global _depth, _saved
    with _lock:
        if _depth == 0:
            _saved = gc.get_threshold()
            gc.set_threshold(max(_saved[0], _YOUNG_THRESHOLD), *_saved[1:])
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _saved is not None:
                gc.set_threshold(*_saved)
                _saved = None
