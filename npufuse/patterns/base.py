"""What every fusion family provides: a pattern (match + build) and the fused ops it emits.

A pattern module holds its matcher, its refusals, its fused-op schema, the NumPy reference kernel and
the ONNX function body; adding a fusion touches that module and one line of the registry.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import onnx
from onnx import helper

from npufuse import FUSED_DOMAIN
from npufuse.fusion.types import Match, Refusal, Replacement
from npufuse.graph import Graph

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
        key = (self.domain, self.op_type, repr(sorted(attrs.items())), opset, elem_type)
        fn = _BODIES.get(key)
        if fn is None:
            fn = _BODIES[key] = self.body(attrs, opset, elem_type)
        node.overload = fn.overload
        return node, fn


_BODIES: dict[tuple, onnx.FunctionProto] = {}   # see FusedOpDef.make_node; callers copy, never mutate


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
