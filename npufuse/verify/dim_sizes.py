"""Sizes for symbolic dims where the user gave none, chosen from what the dim's name says (batch, seq, past, ...)."""

from __future__ import annotations

import re
from collections.abc import Mapping

from npufuse.ir.graph import Shape

# Default sizes for symbolic dims, by what the name says; any other symbol gets OTHER_DIM. None is 0: a
# verification on empty tensors checks nothing (a KV cache's `past` gets 1 position). A name matches a key
# exactly, else by its words (split at `_`, `-`, `.`, digits and camelCase): `past` wins over every other word,
# so `past_sequence_length` and `past_key_values_length` are the cache's length, not the sequence; the other
# keys in the dict's order. A word matches a key it equals or starts with (`seqlen`, `batchsize`, `lengths`).
DEFAULT_DIMS = {"batch": 2, "seq": 8, "sequence": 8, "len": 8, "past": 1, "height": 32, "width": 32}
OTHER_DIM = 4
_FIRST_WORDS = ("past",)   # checked before the others, whatever the dict's order


def name_words(name: str) -> list[str]:
    """`past_key_values_length` -> [past, key, values, length]; `pastSeqLen` -> [past, seq, len]."""
    spaced = re.sub(r"([a-z])([A-Z])", r"\1 \2", name)
    return [w for w in re.split(r"[^a-z]+", spaced.lower()) if w]


def dim_default(name: str, defaults: Mapping[str, int] = DEFAULT_DIMS) -> tuple[int, str] | None:
    """The default for symbolic dim `name` and the key that chose it, or None where no key fits."""
    low = name.lower()
    if low in defaults:
        return defaults[low], low
    words = name_words(name)
    keys = [k for k in _FIRST_WORDS if k in defaults] + [k for k in defaults if k not in _FIRST_WORDS]
    for key in keys:
        if any(w == key or w.startswith(key) for w in words):
            return defaults[key], key
    return None


def concrete_shape(shape: Shape, dims: Mapping[str, int] | None = None, defaults: Mapping[str, int] = DEFAULT_DIMS,
                   other: int = OTHER_DIM) -> tuple[int, ...]:
    """Replace symbolic dims by `dims[name]`, else a default chosen from the name (`other` if none fits)."""
    out = []
    for d in shape:
        if isinstance(d, int):
            out.append(d)
        elif isinstance(d, str) and dims and d in dims:
            out.append(int(dims[d]))
        elif isinstance(d, str):
            found = dim_default(d, defaults)
            out.append(found[0] if found is not None else other)
        else:
            out.append(other)
    return tuple(out)
