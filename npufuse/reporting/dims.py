"""Symbolic dims as a reader should see them: the model's own names, or `?`.

Shape inference names the dims it cannot compute (`unk__17` from onnx; `Reshape_12_o0__d1` from onnxruntime's
symbolic inference). Those names mean nothing to the person who exported the model and change from run to run, so
reports show such a dim as `?` (JSON: null) and, where the cost model priced it, say at what size (`priced_shape`).
The model's own names (its inputs', outputs' and value_info's dim_params) are kept, whatever they look like.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

import onnx

# onnx shape inference: unk__N; onnxruntime symbolic shape inference: <Op><prefix>_<node index>_o<output>__d<dim>
_INVENTED = r"unk__\d+|[A-Za-z][A-Za-z0-9]*_\d+_o\d+__d\d+"
_INVENTED_NAME = re.compile(rf"^(?:{_INVENTED})$")
# in free text a pattern quotes a shape as a Python list (['unk__3', 8, 'sequence']): drop the quotes with the name
_INVENTED_IN_TEXT = re.compile(rf"'({_INVENTED})'|(?<![\w/.])({_INVENTED})(?![\w/])")

# keys whose strings are graph names (values, nodes), never dims: left exactly as the model has them
_NAME_KEYS = frozenset({"name", "node", "nodes", "inputs", "outputs", "value", "model", "output", "graph"})


def own_dim_names(model: onnx.ModelProto) -> frozenset[str]:
    """The dim names the model itself declares: every dim_param of its graph inputs (a `--dim NAME=INT` needs
    the name, whatever it is), and those of its outputs and value_info (main graph and subgraphs) that shape
    inference did not make up (a model saved after inference carries `unk__N` in its value_info)."""
    names: set[str] = set()

    def dims(vis: Iterable[onnx.ValueInfoProto]) -> Iterable[str]:
        for vi in vis:
            if vi.type.HasField("tensor_type") and vi.type.tensor_type.HasField("shape"):
                yield from (d.dim_param for d in vi.type.tensor_type.shape.dim if d.dim_param)

    names.update(dims(model.graph.input))

    def walk(g: onnx.GraphProto) -> None:
        names.update(d for d in dims(list(g.output) + list(g.value_info)) if not _INVENTED_NAME.match(d))
        for n in g.node:
            for a in n.attribute:
                if a.type == onnx.AttributeProto.GRAPH:
                    walk(a.g)
                for sub in a.graphs:
                    walk(sub)

    walk(model.graph)
    return frozenset(names)


def readable_shape(shape: Sequence[int | str | None] | None, own: frozenset[str]) -> list[int | str | None] | None:
    """`shape` with every symbolic dim the model does not name replaced by None (unknown)."""
    if shape is None:
        return None
    return [d if not isinstance(d, str) or d in own else None for d in shape]


def readable_text(text: str, own: frozenset[str]) -> str:
    """`text` (a sentence a pattern or the engine wrote) with invented dim names replaced by `?`."""
    if "__" not in text:   # every invented name has it: most of a report's strings need no regex
        return text

    def sub(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        return m.group(0) if name in own else "?"

    return _INVENTED_IN_TEXT.sub(sub, text)


def readable_document(doc: Any, own: frozenset[str], _key: str = "") -> Any:
    """A report document (or part of one) with invented dim names replaced in every sentence; graph names (values,
    nodes) are left as they are. Structured shapes go through `readable_shape` where they are built."""
    if isinstance(doc, str):
        return readable_text(doc, own) if _key not in _NAME_KEYS else doc
    if isinstance(doc, dict):
        return _readable_dict(doc, own)
    if isinstance(doc, list):
        return [readable_document(v, own, _key) for v in doc]
    return doc


def _readable_dict(doc: dict, own: frozenset[str]) -> dict:
    """`readable_document` of a dict, its plain leaves done here rather than by a call each (a 100k-node graph's
    report has millions)."""
    out = {}
    for k, v in doc.items():
        t = type(v)
        if t is str:
            out[k] = v if k in _NAME_KEYS or "__" not in v else readable_text(v, own)
        elif t is int or t is float or t is bool or v is None:
            out[k] = v
        else:
            out[k] = readable_document(v, own, k)
    return out


def dims_text(shape: Sequence[int | str | None] | None) -> str:
    """A shape as a reader sees it: `?×sequence×128`; `?` for an unknown dim or shape, `scalar` for rank 0. Every
    renderer formats shapes with this."""
    if shape is None:
        return "?"
    return "×".join("?" if d is None else str(d) for d in shape) or "scalar"
