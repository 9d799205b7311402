"""What every fusion family provides: a pattern (match + build) and the fused ops it emits.

A pattern module holds its matcher, its refusals, its fused-op schema, the NumPy reference kernel and
the ONNX function body; adding a fusion touches that module and one line of the registry.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import hashlib

import numpy as np
import onnx
from onnx import helper, numpy_helper

from npufuse import FUSED_DOMAIN
from npufuse.ir.candidates import Match, Refusal, Replacement
from npufuse.ir.graph import Graph

# reference(inputs, attrs) -> outputs; inputs hold None for omitted optional inputs.
ReferenceKernel = Callable[[Sequence[np.ndarray | None], dict[str, Any]], list[np.ndarray]]
# body(attrs, opset, elem_type) -> a FunctionProto (its `overload` says which specialisation it is).
FunctionBody = Callable[[dict[str, Any], int, int], onnx.FunctionProto]


@dataclass(frozen=True)
class FusedOpDef:
    """Schema, reference kernel and function body of one op a pattern emits.

    Usually an `npufuse` op; a standard ONNX op a pattern emits (LayerNormalization at opset >= 17, say)
    is declared the same way with domain "" and no body, so the reference executor has its kernel.
    """

    op_type: str
    doc: str
    inputs: tuple[str, ...]            # names; a trailing '?' marks an optional input
    outputs: tuple[str, ...]
    attributes: tuple[str, ...]        # the attributes the op accepts
    reference: ReferenceKernel
    body: FunctionBody | None          # None for a standard ONNX op (onnxruntime runs it natively)
    domain: str = FUSED_DOMAIN

    def make_node(self, inputs: Sequence[str], outputs: Sequence[str], name: str, attrs: dict[str, Any],
                  opset: int, elem_type: int) -> tuple[onnx.NodeProto, onnx.FunctionProto | None]:
        """The fused node and the function body that lets stock onnxruntime run it (None for a standard op)."""
        unknown = set(attrs) - set(self.attributes)
        if unknown:
            raise ValueError(f"{self.op_type}: unknown attributes {sorted(unknown)}")
        node = helper.make_node(self.op_type, list(inputs), list(outputs), name=name, domain=self.domain,
                                **{k: v for k, v in attrs.items() if v is not None})
        if self.body is None:
            return node, None
        # One body per distinct signature: a 100k-node graph asks for the same few thousands of times.
        body = self.body
        fn = shared_body((self.domain, self.op_type, repr(sorted(attrs.items())), opset, elem_type),
                         lambda: body(attrs, opset, elem_type))
        node.overload = fn.overload
        return node, fn


def shared_body(key: tuple, build: Callable[[], onnx.FunctionProto]) -> onnx.FunctionProto:
    """The function body `build` makes, built once per `key` (which must hold everything the body depends on):
    a 100k-node graph asks for the same few bodies thousands of times, and building one (its nodes, its stamp's
    digest) costs far more than the lookup. The body is shared: callers copy, never mutate."""
    fn = _BODIES.get(key)
    if fn is None:
        fn = _BODIES[key] = build()
    return fn


_BODIES: dict[tuple, onnx.FunctionProto] = {}   # see shared_body


class Pattern(ABC):
    """A fusion family's matcher: `match` finds one candidate at an anchor node, `build` makes it."""

    name: ClassVar[str]                  # stable, used on the CLI (--only/--disable) and in reports
    description: ClassVar[str]
    anchor_ops: ClassVar[frozenset[str]]
    phase: ClassVar[int] = 1             # lower phases run first, each to a fixed point
    fused_ops: ClassVar[tuple[FusedOpDef, ...]] = ()

    @abstractmethod
    def match(self, g: Graph, node: onnx.NodeProto) -> Match | Refusal | None:
        """A match at `node`, a refusal (near-miss with its reason), or None if nothing is there."""

    @abstractmethod
    def build(self, g: Graph, m: Match) -> Replacement:
        """The replacement for `m`, built completely without touching the graph."""


# Opsets a function body can be built for. Below 7 the arithmetic ops broadcast only with a `broadcast` attribute
# and onnxruntime, which runs the bodies, has no kernels; npufuse refuses such models (see fusion.admit).
MIN_OPSET = 7
ERF_OPSET = 9   # Erf, which the exact GELU's formula needs
# Constant's value_float (opset 12) is the only way a body turns a float attribute of its caller into a tensor.
FLOAT_ATTR_REF_OPSET = 12


def float_attr_constant(out: str, attr: str, attrs: dict[str, Any], opset: int, default: float
                        ) -> tuple[onnx.NodeProto, str]:
    """(node, overload token): a Constant making `out` a float32 scalar that holds the calling node's float
    attribute `attr`, valid at `opset`.

    From opset 12 the value is forwarded (value_float referring to `attr`), so one body serves every value, and
    the token is "". Below 12 Constant has only a tensor `value`, which no attribute reference can fill: the value
    (`attrs[attr]`, else `default`) is baked in, and the token names it (its float32 bits). Put the token in the
    body's overload: nodes whose values differ then get different bodies, never one that computes another's."""
    value = attrs.get(attr)
    value = np.float32(default if value is None else value)
    if opset >= FLOAT_ATTR_REF_OPSET and attrs.get(attr) is not None:
        node = helper.make_node("Constant", [], [out])
        node.attribute.append(ref_attr("value_float", onnx.AttributeProto.FLOAT, attr))
        return node, ""
    # An absent attribute is baked in at every opset: a reference to it would leave the Constant without a value.
    node = helper.make_node("Constant", [], [out], value=numpy_helper.from_array(np.array(value, np.float32), out))
    return node, f"{attr}{value.view(np.uint32):08x}"


def overload_with(overload: str, *tokens: str) -> str:
    """`overload` with the non-empty `tokens` (see float_attr_constant) appended."""
    return "__".join([overload, *filter(None, tokens)])


def require_opset(op_type: str, opset: int, minimum: int, why: str) -> None:
    """Refuse to build a body at an opset that lacks an op it needs (the pattern refuses such matches first)."""
    if opset < minimum:
        raise ValueError(f"{op_type}'s function body needs opset >= {minimum} ({why}), the model has {opset}")


BODY_STAMP_KEY = "npufuse.body_sha256"   # a FunctionProto metadata_props key (IR >= 10)


def make_body(*args: Any, **kwargs: Any) -> onnx.FunctionProto:
    """helper.make_function, stamped: every function body npufuse writes carries the digest of its content, by
    which npufuse tells its own bodies from a model's functions of the same name (see fusion.admit)."""
    return stamped(helper.make_function(*args, **kwargs))


def stamped(fn: onnx.FunctionProto) -> onnx.FunctionProto:
    """A copy of `fn` carrying the digest of its content, which `is_npufuse_body` checks."""
    out = onnx.FunctionProto()
    out.CopyFrom(fn)
    del out.metadata_props[:]
    out.metadata_props.add(key=BODY_STAMP_KEY, value=_digest(out))
    return out


def is_npufuse_body(fn: onnx.FunctionProto) -> bool:
    """True if `fn` is a body npufuse wrote, unchanged since (its stamp matches its content)."""
    stamps = [p.value for p in fn.metadata_props if p.key == BODY_STAMP_KEY]
    return len(stamps) == 1 and stamps[0] == _digest(fn)


def _digest(fn: onnx.FunctionProto) -> str:
    bare = onnx.FunctionProto()
    bare.CopyFrom(fn)
    del bare.metadata_props[:]
    return hashlib.sha256(bare.SerializeToString(deterministic=True)).hexdigest()


def ref_attr(name: str, attr_type: int, ref: str | None = None) -> onnx.AttributeProto:
    """An attribute of a function-body node that takes its value from the calling node's attribute."""
    a = onnx.AttributeProto(name=name, type=attr_type, ref_attr_name=ref or name)
    return a


def node_with_refs(op_type: str, inputs: Sequence[str], outputs: Sequence[str],
                   refs: Sequence[tuple[str, int]] = (), **attrs: Any) -> onnx.NodeProto:
    """A function-body node whose attributes in `refs` are forwarded from the calling node."""
    n = helper.make_node(op_type, list(inputs), list(outputs), **attrs)
    n.attribute.extend(ref_attr(name, t) for name, t in refs)
    return n


def unique_name(g: Graph, base: str, taken: set[str]) -> str:
    """A value/initializer name not used anywhere in `g` nor in `taken` (which it then joins)."""
    name, k = base, 1
    while name in taken or name in g.producer or name in g.initializers or name in g.consumers:
        name = f"{base}_{k}"
        k += 1
    taken.add(name)
    return name
