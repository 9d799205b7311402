"""Seeded inputs that fit each value's role: ids within the table they index, masks of 0/1, floats ~N(0,1)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx

from npufuse.errors import InputError
from npufuse.ir.graph import Graph
from npufuse.verify.dim_sizes import (  # noqa: F401
    DEFAULT_DIMS,
    OTHER_DIM,
    concrete_shape,
    dim_default,
    dim_expression,
    dim_size,
    is_dim_expression,
    name_words,
)

def input_symbols(g: Graph) -> list[str]:
    """The symbolic dims of the graph's inputs (weights left out), in order of first appearance."""
    seen: dict[str, None] = {}
    for name in g.graph_inputs:
        if name not in g.initializers:
            for d in g.shape(name) or ():
                if isinstance(d, str):
                    seen.setdefault(d, None)
    return list(seen)


def unmatched_dims(g: Graph, dims: Mapping[str, int] | None) -> list[str]:
    """Input symbols that neither `--dim` sets nor any default's name fits: they get OTHER_DIM silently
    otherwise, so the run says so (see `fusion.engine`)."""
    return [d for d in input_symbols(g) if d not in (dims or {}) and dim_default(d) is None
            and not is_dim_expression(d)]


def _index_bound(g: Graph, value: str) -> int | None:
    """The size of the table `value` indexes (Gather/GatherElements data on a constant), if any."""
    for c in g.consumers_of(value):
        if c.op_type == "Gather" and len(c.input) > 1 and c.input[1] == value:
            data = g.shape(c.input[0])
            axis = next((a.i for a in c.attribute if a.name == "axis"), 0)
            if data is not None and isinstance(data[axis], int):
                return data[axis]
        if c.op_type in ("Cast", "Unsqueeze", "Reshape", "Flatten", "Identity") and c.input[0] == value:
            bound = _index_bound(g, c.output[0])
            if bound is not None:
                return bound
    return None


def check_dims(g: Graph, dims: Mapping[str, int] | None) -> None:
    """Refuse `--dim` names the model's inputs do not have (a typo would otherwise change nothing)."""
    symbols = set(input_symbols(g))
    unknown = sorted(set(dims or {}) - symbols)
    if unknown:
        known = ", ".join(sorted(symbols)) or "none: every input dim is fixed"
        raise InputError(f"--dim {unknown[0]}: the model's inputs have no such symbolic dim (they have: {known})")


# Ops whose input must be positive to mean anything (a negative one gives NaN, and NaN compares equal to NaN).
_POSITIVE_DOMAIN_OPS = frozenset({"Log", "Sqrt", "Reciprocal", "Pow"})


def _needs_positive(g: Graph, value: str) -> bool:
    """True if `value` feeds, directly or through value-preserving ops, an op defined on positives only."""
    frontier, seen = [value], set()
    while frontier:
        v = frontier.pop()
        for c in g.consumers_of(v):
            if c.op_type in _POSITIVE_DOMAIN_OPS and c.input[0] == v:
                exponent = g.scalar(c.input[1]) if c.op_type == "Pow" else None
                if exponent is None or not float(exponent).is_integer():
                    return True
            if c.op_type in ("Identity", "Cast", "Reshape", "Unsqueeze", "Squeeze", "Flatten") and \
                    c.output[0] not in seen:
                seen.add(c.output[0])
                frontier.append(c.output[0])
    return False


def model_inputs(g: Graph, seed: int = 0, dims: Mapping[str, int] | None = None, *,
                 skip_hint: str = "skip the numeric checks (optimize/report --no-verify)") -> dict[str, np.ndarray]:
    """Seeded inputs for every graph input of `g`. `skip_hint`: what the caller's user can do instead when they
    cannot fit memory (a check cannot be skipped the way optimize's verification can)."""
    from npufuse.verify.memory_fit import check_fits_memory

    check_fits_memory(g, dims, skip_hint=skip_hint)  # before allocating: a MemoryError would be a traceback
    rng = np.random.default_rng(seed)
    feeds: dict[str, np.ndarray] = {}
    # position ids continue a KV cache: they start at the cache's length (the first input dim named past...)
    past = next((dim_size(d, dims) for d in input_symbols(g)
                 if name_words(d)[:1] == ["past"] and not is_dim_expression(d)), 0)
    for name in g.graph_inputs:
        if name in g.initializers:
            continue  # an overridable weight keeps its stored value
        shape = g.shape(name)
        dtype = g.dtype(name)
        if shape is None or dtype is None:
            raise InputError(f"graph input {name!r} has no declared shape or type; npufuse cannot make inputs "
                             "for it (declare it in the model, e.g. with onnx.shape_inference)")
        feeds[name] = value_for(g, name, concrete_shape(shape, dims), dtype, rng, positions_from=past)
    return feeds


def value_for(g: Graph | None, name: str, shape: tuple[int, ...], dtype: np.dtype,
              rng: np.random.Generator, positions_from: int = 0) -> np.ndarray:
    """A seeded array for value `name` whose contents fit what the value is used for (always an ndarray: a 0-d
    value drawn by numpy comes back as a scalar, which onnxruntime refuses as a feed). `positions_from`: where
    position ids start (the KV cache's length)."""
    if np.dtype(dtype).name == "bfloat16":
        # numpy has no bf16 arithmetic of its own: draw in fp32, round to bf16 (ml_dtypes, onnx's own dtype)
        return np.asarray(_value_for(g, name, shape, np.dtype(np.float32), rng, positions_from)).astype(dtype)
    return np.asarray(_value_for(g, name, shape, dtype, rng, positions_from))


def _value_for(g: Graph | None, name: str, shape: tuple[int, ...], dtype: np.dtype,
               rng: np.random.Generator, positions_from: int = 0) -> np.ndarray:
    lname = name.lower()
    if dtype == np.bool_:
        return rng.random(shape) < 0.8
    if np.issubdtype(dtype, np.integer):
        if "position" in lname and len(shape) >= 1:
            # position ids: the next positions after the cache, as a generate step feeds them (random ids could
            # index past a rotary table or repeat); kept within the table a Gather reads them from
            bound = _index_bound(g, name) if g is not None else None
            pos = np.arange(positions_from, positions_from + shape[-1])
            if bound is not None:
                pos = np.minimum(pos, max(bound - 1, 0))
            return np.broadcast_to(pos, shape).astype(dtype).copy()
        if "mask" in lname:
            arr = (rng.random(shape) < 0.8).astype(dtype)
            if arr.ndim >= 1 and arr.shape[-1] > 0:
                arr[..., 0] = 1  # keep at least one visible position per row
            return arr
        bound = _index_bound(g, name) if g is not None else None
        if bound is None:
            bound = 2 if "type" in lname else 4
        return rng.integers(0, max(bound, 1), size=shape).astype(dtype)
    if np.issubdtype(dtype, np.floating):
        if "mask" in lname:
            return (rng.random(shape) < 0.8).astype(dtype)
        if g is not None and _needs_positive(g, name):
            return rng.uniform(0.1, 2.0, shape).astype(dtype)
        return rng.standard_normal(shape).astype(dtype)
    raise InputError(f"value {name!r} has dtype {dtype}, which npufuse cannot generate inputs for")


def synthetic_value(g: Graph, name: str, rng: np.random.Generator,
                    dims: Mapping[str, int] | None = None) -> np.ndarray | None:
    """An input for an intermediate value from its inferred type, or None where the type is unknown."""
    shape, dtype = g.shape(name), g.dtype(name)
    if shape is None or dtype is None or g.elem_type(name) == onnx.TensorProto.UNDEFINED:
        return None
    return value_for(g, name, concrete_shape(shape, dims), dtype, rng)
