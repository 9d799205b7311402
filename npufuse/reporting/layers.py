"""Which layer of a deep model a region lies in, so a report on a 12-80-layer model can be read layer by layer.

The layer comes from the names exporters give: TorchScript scopes the node name (`/encoder/layer.3/attention/...`,
`/model/layers.3/mlp/...`, GPT-2's `/h.3/`), newer dynamo exports name nodes `node_layers_3_...`, and dynamo
records the module path in the node's `namespace` metadata (`m.encoder.layer.3: BertLayer/...`). A layer is the
scope up to the first index of a repeated-stack word (`layer`, `layers`, `h`, `block`, `blocks`):
`encoder.layer.3`, `model.layers.3`, `decoder.block.1`; what comes before it stays, so an encoder's and a
decoder's layers are told apart. Where no node carries a layer, the model is cut into topological blocks of equal
node count (`nodes 0-99`), so a big graph without names still reads in pieces.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import onnx

# a stack word and its index, as a whole scope step: `layer.3`, `layers_3`, `h.3`, `blocks.0`
_STACK = re.compile(r"(?:^|(?<=[/._]))(?P<word>layers?|h|blocks?)[._](?P<i>\d+)(?=$|[/._])", re.IGNORECASE)
TOPOLOGICAL_BLOCKS = 12   # blocks the fallback cuts a graph without layer names into


def _scope(node: onnx.NodeProto) -> str:
    """The module path of `node`: dynamo's `namespace` metadata (`: Wrapper/m: Model/m.layers.0: Layer/.../
    linear_2: aten.linear.default`: its deepest module path, the longest), else the node's name."""
    for p in node.metadata_props:
        if p.key == "namespace" and p.value:
            scopes = [seg.split(":")[0].strip() for seg in p.value.split("/")]
            return max(scopes, key=len) or node.name
    return node.name


def layer_label(scope: str) -> tuple[str, int] | None:
    """(label, index) of the layer `scope` lies in: `/m/encoder/layer.3/attention/self/MatMul` ->
    (`m.encoder.layer.3`, 3); None where the scope names no layer."""
    m = _STACK.search(scope)
    if m is None:
        return None
    if scope.startswith("node_"):   # dynamo's flattened names: node_model_layers_3_..., scopes joined by _
        parts = [p for p in scope[len("node_"): m.start()].split("_") if p]
    else:
        parts = [p for p in re.split(r"[/.]", scope[: m.start()]) if p]
    label = ".".join(parts + [m.group("word"), m.group("i")])
    return label, int(m.group("i"))


def node_layers(nodes: Iterable[onnx.NodeProto]) -> dict[str, tuple[str, int]]:
    """{node name: (layer label, index)} for the nodes whose scope names a layer."""
    out = {}
    for n in nodes:
        found = layer_label(_scope(n))
        if found is not None:
            out[n.name] = found
    return out


def region_layer(names: Sequence[str], layers: Mapping[str, tuple[str, int]]) -> str | None:
    """The layer most of `names` lie in (the first node's on a tie: a residual Add of layer 3 fused with the norm
    that opens layer 4 belongs to layer 3); None if none names a layer."""
    found = [layers[n][0] for n in names if n in layers]
    if not found:
        return None
    counts = Counter(found)
    top = max(counts.values())
    return next(f for f in found if counts[f] == top)


def assign_layers(nodes: Sequence[onnx.NodeProto], groups: Sequence[Sequence[str]]) -> tuple[list[str | None], str]:
    """The layer of each group of node names (a region's nodes, a near-miss's chain), and where the layers came
    from: `names`, `topological-blocks` (no node names a layer: blocks of equal node count), or `none` (nothing
    to group)."""
    layers = node_layers(nodes)
    if layers:
        return [region_layer(g, layers) for g in groups], "names"
    if not groups or not nodes:
        return [None] * len(groups), "none"
    position = {n.name: i for i, n in enumerate(nodes)}
    size = -(-len(nodes) // TOPOLOGICAL_BLOCKS)
    width = len(str(len(nodes)))
    out: list[str | None] = []
    for g in groups:
        at = [position[n] for n in g if n in position]
        if not at:
            out.append(None)
            continue
        b = min(at) // size
        out.append(f"nodes {b * size:0{width}d}-{min((b + 1) * size, len(nodes)) - 1:0{width}d}")
    return out, "topological-blocks"


def layer_order(labelled: Iterable[tuple[str | None, int]]) -> list[str]:
    """The distinct layer labels in model order, from (label, topological position) pairs: stacks by where they
    first appear (an encoder before its decoder), layers of one stack by index."""
    first: dict[str, int] = {}
    for lab, pos in labelled:
        if lab is not None:
            first[lab] = min(first.get(lab, pos), pos)
    stack_first: dict[str, int] = {}
    for lab, pos in first.items():
        p = split_label(lab)[0]
        stack_first[p] = min(stack_first.get(p, pos), pos)

    def key(lab: str) -> tuple[Any, ...]:
        p, idx = split_label(lab)
        return (stack_first[p], p, idx if idx is not None else first[lab], lab)

    return sorted(first, key=key)


def split_label(label: str) -> tuple[str, int | None]:
    """(`m.encoder.layer`, 3) from `m.encoder.layer.3`; a topological block keeps its whole label."""
    m = re.fullmatch(r"(.*)\.(\d+)", label)
    if m is None or label.startswith("nodes "):
        return label, None
    return m.group(1), int(m.group(2))
