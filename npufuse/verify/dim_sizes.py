"""Sizes for symbolic dims where the user gave none, chosen from what the dim's name says (batch, seq, past, ...)."""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Mapping

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


def dim_size(name: str, dims: Mapping[str, int] | None = None, defaults: Mapping[str, int] = DEFAULT_DIMS,
             other: int = OTHER_DIM) -> int:
    """The size of symbolic dim `name`: `dims[name]`; for a dim the exporter wrote as arithmetic of others
    (optimum's `past_sequence_length + sequence_length`, dynamo's `s0 + 1`, `2*s1`) that arithmetic on their sizes;
    else a default chosen from the name (`other` if none fits)."""
    if dims and name in dims:
        return int(dims[name])
    value = dim_expression(name, lambda part: dim_size(part, dims, defaults, other))
    if value is not None:
        return value if value >= 0 else other
    found = dim_default(name, defaults)
    return found[0] if found is not None else other


_ARITHMETIC = (ast.Add, ast.Sub, ast.Mult, ast.FloorDiv)


def is_dim_expression(name: str) -> bool:
    """True if `name` is arithmetic of other dims (`past_sequence_length + sequence_length`), not a dim of its own."""
    return dim_expression(name, lambda part: 1) is not None


def dim_expression(name: str, size_of: Callable[[str], int]) -> int | None:
    """The value of `name` if it is integer arithmetic (+, -, *, //) of dim names and numbers, else None."""
    if not any(c in name for c in "+-*/") or len(name) > 200:
        return None
    try:
        tree = ast.parse(name.replace(" ", ""), mode="eval").body
    except SyntaxError:
        return None

    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.BinOp) and isinstance(node.op, _ARITHMETIC):
            a, b = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.FloorDiv):
                return a // b if b else 0
            return {ast.Add: a + b, ast.Sub: a - b, ast.Mult: a * b}[type(node.op)]
        if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
            return int(node.value)
        if isinstance(node, ast.Name):
            return size_of(node.id)
        raise ValueError(name)

    try:
        return ev(tree)
    except (ValueError, RecursionError):
        return None


def concrete_shape(shape: Shape, dims: Mapping[str, int] | None = None, defaults: Mapping[str, int] = DEFAULT_DIMS,
                   other: int = OTHER_DIM) -> tuple[int, ...]:
    """Replace symbolic dims by their size (`dim_size`): `dims[name]`, the arithmetic of other dims an exporter
    wrote, else a default chosen from the name (`other` if none fits)."""
    return tuple(d if isinstance(d, int) else dim_size(d, dims, defaults, other) if isinstance(d, str) else other
                 for d in shape)
