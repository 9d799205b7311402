"""The report document: every candidate with its cost estimate and fate, near-misses, and the model's
modeled time and GM traffic before and after, per op kind. Renderers only format this document."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import onnx

from npufuse import __version__
from npufuse.calibrate.provenance import calibration_block
from npufuse.cost_model import ModelEstimate, OpWork, estimate_ops
from npufuse.cost_model.decide import atc_unfused_patterns, unmeasured_patterns, validated_error
from npufuse.fusion.branches import BranchChoice, ops_through_branches
from npufuse.fusion.costing import CostShapes
from npufuse.fusion.engine import APPLIED, OptimizeResult
from npufuse.fusion.coverage import unaccounted
from npufuse.fusion.opportunities import find_opportunities
from npufuse.ir.graph import Graph
from npufuse.prepare.infer import infer_value_types
from npufuse.prepare.normalize import normalize
from npufuse.reporting.dims import own_dim_names, readable_document, readable_shape
from npufuse.reporting.layers import assign_layers, layer_order

REPORT_SCHEMA = "npufuse.report/1"


@dataclass(frozen=True)
class PricedModel:
    """The model before and after fusion, each priced whole (every compute node its own kernel)."""

    before_graph: Graph
    before_shapes: CostShapes
    before: ModelEstimate
    after_graph: Graph
    after_shapes: CostShapes
    after: ModelEstimate
    after_ops: Sequence[OpWork]   # what `after` prices, for pricing the same graph under other terms
    branches: Sequence[BranchChoice] = ()   # the If branches `after` priced (fusion.branches)
    types: Mapping[str, onnx.TypeProto] | None = None   # the normalised original's value types

    def modeled_time_us(self) -> dict[str, Any]:
        gain = self.before.time_us - self.after.time_us
        return {"before": round(self.before.time_us, 3), "after": round(self.after.time_us, 3),
                "gain": round(gain, 3),
                "speedup": round(self.before.time_us / self.after.time_us, 4) if self.after.time_us else None}


def price_model(original: onnx.ModelProto, result: OptimizeResult, spec: Any, base_dir: str | None,
                dims: Mapping[str, int] | None) -> PricedModel:
    """The one whole-model pricing `npufuse report`, `optimize --report` and `calibrate` share: the normalised
    original and the optimized graph at deployment sizes (`dims`), on `spec` under its precision mode."""
    # the engine's own normalisation where it kept it (the same function of the same input)
    before_model, types = result.normalized or normalize(original, base_dir)
    before_graph = Graph(before_model, base_dir, types)
    before_shapes = CostShapes(before_model, dims)
    # an If costs its costlier branch (fusion.branches); the report names the branches the optimized model priced
    before = estimate_ops(ops_through_branches(before_graph, before_shapes, spec, base_dir, dims, []), spec)
    after_graph, after_shapes, after_ops, choices = _price_fused(result.model, types, before_shapes, spec, base_dir,
                                                                 dims)
    after = estimate_ops(after_ops, spec)
    return PricedModel(before_graph, before_shapes, before, after_graph, after_shapes, after, after_ops, choices,
                       types)


def _price_fused(fused: onnx.ModelProto, types: Mapping[str, onnx.TypeProto], before_shapes: CostShapes, spec: Any,
                 base_dir: str | None, dims: Mapping[str, int] | None) -> tuple:
    """A fused model's graph, shapes and work at deployment sizes, as `price_model` prices `after` (and `calibrate`
    a row): the normalised original's types, then the fused model's own; its shapes fall back to the original's."""
    after_types = dict(types)
    after_types.update({k: v for k, v in infer_value_types(fused).items() if k not in after_types})
    graph = Graph(fused, base_dir, after_types)
    shapes = CostShapes(fused, dims, fallback=before_shapes)
    choices: list[BranchChoice] = []
    ops = ops_through_branches(graph, shapes, spec, base_dir, dims, choices)
    return graph, shapes, ops, choices


def atc_alone(original: onnx.ModelProto, spec: Any, base_dir: str | None, dims: Mapping[str, int] | None,
              m: PricedModel) -> dict[str, Any] | None:
    """The export as ATC compiles it by itself, modeled: fused with the patterns whose work a CANN fusion pass does
    (emit/fusion_switch.tsv: ConvBatchnormFusionPass, MatMulBiasAddFusionPass, LayerNormFusionPass, ...) less those
    the profile's calibration ran disabled (`atc_unfused_patterns`: its published compiles ran without them), at
    the default margin, and priced as `after` is. On the calibration's own models that is how `npufuse calibrate`
    prices a row (their fusions all have a pass); an RMSNorm, a rotary embedding or a gated MLP, which no CANN pass
    in the table fuses, stays unfused. Published ATC timings of a plain export are compared with this figure, and
    npufuse's own gain is measured against it: `before` prices every node as its own kernel, which ATC never runs.
    None where the profile says nothing about ATC's own fusions (its calibration timed no whole compile)."""
    disabled = atc_unfused_patterns(spec)
    if disabled is None:
        return None
    # a second engine run, without verification
    from npufuse.emit.fusion_switch import cann_passes
    from npufuse.fusion.engine import OptimizeOptions, optimize, require_patterns
    from npufuse.patterns import PATTERNS

    own = sorted({p for cp in cann_passes().values() for p in cp.patterns} - disabled)
    opts = OptimizeOptions(patterns=require_patterns(own, ()), spec=spec, verify=False, dims=dict(dims or {}))
    alone = optimize(original, base_dir, opts)
    _, _, ops, _ = _price_fused(alone.model, m.types or {}, m.before_shapes, spec, base_dir, dims)
    time_us = estimate_ops(ops, spec).time_us
    return {"time_us": round(time_us, 3), "patterns": own,
            "without": sorted(p.name for p in PATTERNS if p.name not in own),
            "speedup": round(time_us / m.after.time_us, 4) if m.after.time_us else None}


def _sigmoid_hint(m: PricedModel, spec: Any) -> dict[str, Any] | None:
    """What ATC's high-precision Sigmoid (its default, npu_model.impl_mode) costs in the optimized model, and its time
    with the fast kernel, where the profile prices the two apart, the compile left the choice to ATC's default list
    and it moves the time by 1% or more (None otherwise): the flag is the user's to pass, to ATC and to npufuse."""
    if getattr(spec, "sigmoid_high_precision_factor", 1.0) == 1.0 or spec.op_select_implmode != "high_performance" \
            or "Sigmoid" in spec.optypelist_for_implmode:
        return None
    fast = spec.with_impl_mode("high_performance", (*spec.optypelist_for_implmode, "Sigmoid"))
    fast_us = estimate_ops(m.after_ops, fast).time_us
    extra = m.after.time_us - fast_us
    if m.after.time_us <= 0 or extra < 0.01 * m.after.time_us:
        return None
    return {"extra_us": round(extra, 3), "share_pct": round(100.0 * extra / m.after.time_us, 1),
            "after_us_with_fast_sigmoid": round(fast_us, 3),
            "atc_flags": "--optypelist_for_implmode=Sigmoid --op_select_implmode=high_performance"}


def _unmeasured_hint(m: PricedModel, result: OptimizeResult, spec: Any) -> dict[str, Any] | None:
    """The share of the optimized model's time in fused kernels of patterns the profile's calibration ran disabled
    (cost_model.decide.unmeasured_patterns): no published row measured them, so that part of the figure is the
    physics alone (None where there is none)."""
    if validated_error(spec) is None:
        return None
    unmeasured = unmeasured_patterns(spec)
    absorbed = result.absorbed_into()   # a fused node a later fusion took is that fusion's kernel, not this one's
    records = [r for i, r in enumerate(result.records) if r.status == APPLIED and r.match.pattern in unmeasured
               and i not in absorbed and not r.graph and r.decision is not None]   # the main graph's kernels
    names = {k.name for r in records for k in r.decision.fused}
    kernels = [k for k in m.after.kernels if k.name in names and k.launches]
    time_us = sum(k.t_total_us for k in kernels)
    if not kernels or m.after.time_us <= 0:
        return None
    return {"patterns": sorted({r.match.pattern for r in records}),
            "kernels": len(kernels), "time_us": round(time_us, 3),
            "share_pct": round(100.0 * time_us / m.after.time_us, 1)}


def build_report(original: onnx.ModelProto, result: OptimizeResult, spec: Any, model_path: str,
                 base_dir: str | None = None, dims: Mapping[str, int] | None = None,
                 verified: bool = True) -> dict[str, Any]:
    """The report of one optimize run on `spec` (documented in docs/report.md)."""
    m = price_model(original, result, spec, base_dir, dims)
    before_graph, before_shapes, before = m.before_graph, m.before_shapes, m.before
    after_graph, after_shapes, after = m.after_graph, m.after_shapes, m.after
    assumed = _assumed_shapes(before_graph, before_shapes, before)
    candidates = [r.to_dict() for r in result.records]
    status_counts: dict[str, int] = {}
    for r in result.records:
        status_counts[r.status] = status_counts.get(r.status, 0) + 1
    priced = _Priced(before_graph, before_shapes, after_graph, after_shapes, own_dim_names(original))
    region_list = regions(before_graph, after_graph, result, priced)
    near_misses = [f.to_dict() for f in result.refusals]
    layers, layer_source = _layers(before_graph, region_list, near_misses)
    opportunities = _opportunities(result, before_graph, priced, before.time_us)
    return readable_document({
        "schema": REPORT_SCHEMA,
        "npufuse_version": __version__,
        "model": model_path,
        "target": {"name": spec.name, "description": getattr(spec, "description", ""),
                   "precision_mode": getattr(spec, "precision_mode", None),
                   "op_select_implmode": getattr(spec, "op_select_implmode", None),
                   "optypelist_for_implmode": list(getattr(spec, "optypelist_for_implmode", ())),
                   "numbers": dict(spec.describe())}
        # ATC's --enable_small_channel, where the compile sets it (absent otherwise: the default)
        | ({"enable_small_channel": True} if getattr(spec, "enable_small_channel", False) else {})
        | calibration_block(spec),
        "verified": verified,
        "summary": {
            "candidates": len(result.records),
            "by_status": status_counts,
            "near_misses": len(result.refusals),
            "applied_by_kind": dict(sorted(result.applied_by_kind().items())),
            "absorbed_by_kind": dict(sorted(result.absorbed_by_kind().items())),
            "not_fused_by_reason": dict(sorted(result.refused_by_reason().items())),
            "modeled_time_us": m.modeled_time_us(),
            "gm_bytes": {"before": before.gm_bytes, "after": after.gm_bytes},
            "launches": {"before": before.launches, "after": after.launches},
            "nodes": {"before": result.nodes_before, "after": result.nodes_after},
            "model_check": result.model_check.to_dict() if result.model_check else None,
            "canonical": dict(sorted(result.canonical.items())),
            "unaccounted": [a.to_dict() for a in unaccounted(result)],
            "notes": list(result.notes),
            "assumed_shapes": assumed,
            "sigmoid_high_precision": _sigmoid_hint(m, spec),
            "unmeasured_kernels": _unmeasured_hint(m, result, spec),
            "atc_alone": atc_alone(original, spec, base_dir, dims, m),
        } | ({"if_branches": [b.to_dict() for b in m.branches]} if m.branches else {}),
        "model_estimate": {"before": before.to_dict(), "after": after.to_dict()},
        "candidates": candidates,
        "near_misses": near_misses,
        "regions": region_list,
        "layers": layers,
        "layer_source": layer_source,
        "opportunities": opportunities,
    }, priced.own)


def _assumed_shapes(g: Graph, shapes: CostShapes, before: Any) -> dict[str, Any]:
    """The ops of the unfused model priced on a shape no inference could tell (a dim, or the whole shape, priced
    at 1), and the share of the modeled time they carry: a figure built on them must say so."""
    static = shapes.static   # shape arithmetic the pricing sizes fix: not priced, so no figure rests on it
    nodes = {n.name for n in g.nodes if any(v in shapes.assumed for v in (*n.input, *n.output) if v)
             and not all(o in static for o in n.output if o)}
    t = sum(k.t_total_us for k in before.kernels if k.name in nodes)
    ordered = [k.name for k in before.kernels if k.name in nodes]
    return {"ops": len(ordered), "time_us": round(t, 3),
            "share_pct": round(t / before.time_us * 100.0, 2) if before.time_us else 0.0,
            "values": sorted(shapes.assumed)[:20], "nodes": ordered[:20]}


def _opportunities(result: OptimizeResult, before: Graph, priced: "_Priced", model_time_us: float) -> dict[str, Any]:
    """Kernel opportunities (fusion.opportunities), each region with the shapes its fused node would read."""
    def dtype_of(rec: Any) -> str | None:
        dt = before.dtype(rec.match.inputs[0]) if rec.match.inputs else None
        return dt.name if dt is not None else None

    def shapes(i: int) -> dict[str, Any]:
        rec = result.records[i]
        rep = rec.replacement
        if rep is None or not rep.nodes:
            return {v: priced.value_type(v) for v in rec.match.inputs}
        made = {t.name: {"shape": list(t.dims), "dtype": None} for t in rep.initializers}
        node = rep.nodes[0]
        return {v: made.get(v) or priced.value_type(v) for v in [*node.input, *node.output] if v}

    found, left_out = find_opportunities(result, dtype_of)
    kernels = []
    for opp in found:
        d = opp.to_dict(model_time_us)
        for r in d["regions"]:
            r["values"] = shapes(r["candidate"])
        kernels.append(d)
    return {"kernels": kernels, "left_out": [r.to_dict() for r in left_out]}


def _layers(before: Graph, region_list: list[dict[str, Any]], near_misses: list[dict[str, Any]]
            ) -> tuple[list[str], str]:
    """Give each region and near-miss its `layer` (reporting.layers); the layers in model order and their source."""
    groups = [[n["name"] for n in r["nodes"]] for r in region_list]
    groups += [list(f.get("nodes") or []) + [f["node"]] for f in near_misses]
    labels, source = assign_layers(before.nodes, groups)
    for item, lab in zip(region_list + near_misses, labels):
        item["layer"] = lab
    position = {n.name: i for i, n in enumerate(before.nodes)}
    labelled = [(lab, min((position[n] for n in g if n in position), default=len(position)))
                for g, lab in zip(groups, labels)]
    return layer_order(labelled), source


class _Priced:
    """A value's shape as the report shows it: the model's own dim names or null (`reporting.dims`), and where a
    dim is symbolic or unknown, the concrete shape the cost model priced it at."""

    def __init__(self, before: Graph, before_shapes: CostShapes, after: Graph, after_shapes: CostShapes,
                 own: frozenset[str]) -> None:
        self.before, self.before_shapes, self.after, self.after_shapes = before, before_shapes, after, after_shapes
        self.own = own

    def value_type(self, v: str) -> dict[str, Any]:
        in_before = self.before.type_of(v) is not None or v in self.before.initializers
        g, shapes = (self.before, self.before_shapes) if in_before else (self.after, self.after_shapes)
        shape = g.shape(v)
        dtype = g.dtype(v)
        out: dict[str, Any] = {"shape": readable_shape(list(shape), self.own) if shape is not None else None,
                               "dtype": dtype.name if dtype is not None else None}
        if shape is None or not all(isinstance(d, int) for d in shape):
            try:
                out["priced_shape"] = list(shapes.shape(g, v))
            except Exception:   # pricing shapes are advice: a value they cannot size is shown without one
                pass
        return out


def regions(before: Graph, after: Graph, result: OptimizeResult, priced: _Priced) -> list[dict[str, Any]]:
    """One entry per candidate (same order as `candidates`): the matched subgraph as the engine saw it.

    Candidates of a later round may contain a node an earlier fusion made (a FusedMatMul absorbs a fused
    Gelu): the graph is replayed record by record, so each region shows the nodes it really matched and
    `from_region` points at the region that made such a node.
    """
    state: dict[str, dict[str, Any]] = {
        n.name: {"op_type": _op_type(n), "inputs": [v for v in n.input if v],
                 "outputs": [v for v in n.output if v], "region": None} for n in before.nodes}
    fused_by_replaced: dict[tuple[str, ...], list[onnx.NodeProto]] = {}
    for n in after.nodes:
        meta = {p.key: p.value for p in n.metadata_props}
        if "npufuse.replaced" in meta:
            fused_by_replaced.setdefault(tuple(meta["npufuse.replaced"].split(",")), []).append(n)
    absorbed = result.absorbed_into()
    value_type = priced.value_type
    out: list[dict[str, Any]] = []
    originals: list[list[str]] = []
    for i, r in enumerate(result.records):
        nodes, original = [], []
        for name, op in zip(r.match.nodes, r.node_ops):
            st = state.get(name) or {"op_type": op, "inputs": [], "outputs": [], "region": None}
            nodes.append({"name": name, "op_type": st["op_type"], "inputs": list(st["inputs"]),
                          "outputs": list(st["outputs"]), "from_region": st["region"]})
            original.extend(originals[st["region"]] if st["region"] is not None else [name])
        original = list(dict.fromkeys(original))
        _fit_made_nodes(nodes, r.match.inputs)
        originals.append(original)
        fused_nodes = []
        if r.status == APPLIED:
            fused_nodes = [{"name": n.name, "op_type": _op_type(n), "attributes": _attributes(n)}
                           for n in fused_by_replaced.get(tuple(original), [])]
            made = {"op_type": "+".join(r.fused_ops) or r.match.kind, "inputs": list(r.match.inputs),
                    "outputs": list(r.match.outputs), "region": i}
            for name in r.match.nodes:
                state[name] = made
        out.append({
            "candidate": i, "pattern": r.match.pattern, "kind": r.match.kind, "status": r.status,
            "nodes": nodes,
            "inputs": [dict(name=v, constant=_is_constant(before, after, v), **value_type(v))
                       for v in r.match.inputs],
            "outputs": [dict(name=v, graph_output=v in before.graph_outputs, **value_type(v))
                        for v in r.match.outputs],
            "fused_ops": list(r.fused_ops), "fused_nodes": fused_nodes,
            "absorbed_into": absorbed.get(i),
        } | ({"graph": r.graph} if r.graph else {}))   # where a region inside a subgraph lies
    return out


def _fit_made_nodes(nodes: list[dict[str, Any]], boundary: Sequence[str]) -> None:
    """A node an earlier fusion made is known by that fusion's boundary: keep the inputs this region still
    reads, and give it the boundary inputs no other node reads (weights the earlier rewrite created)."""
    made = [n for n in nodes if n["from_region"] is not None]
    if not made:
        return
    produced = {v for n in nodes for v in n["outputs"]}
    for n in made:
        n["inputs"] = [v for v in n["inputs"] if v in produced or v in boundary]
    read = {v for n in nodes for v in n["inputs"]}
    if len(made) == 1:
        made[0]["inputs"] += [v for v in boundary if v not in read]


def _op_type(n: onnx.NodeProto) -> str:
    return f"{n.domain}.{n.op_type}" if n.domain not in ("", "ai.onnx") else n.op_type


def _is_constant(before: Graph, after: Graph, v: str) -> bool:
    return before.is_constant(v) or after.is_constant(v) or v in after.initializers


def _attributes(n: onnx.NodeProto) -> dict[str, Any]:
    """The fused node's plain attributes (numbers, strings and lists of them); tensors and graphs left out."""
    out: dict[str, Any] = {}
    plain = {onnx.AttributeProto.INT, onnx.AttributeProto.FLOAT, onnx.AttributeProto.STRING,
             onnx.AttributeProto.INTS, onnx.AttributeProto.FLOATS, onnx.AttributeProto.STRINGS}
    for a in n.attribute:
        if a.type not in plain:
            continue
        v = onnx.helper.get_attribute_value(a)
        if isinstance(v, bytes):
            v = v.decode("utf-8", "replace")
        elif isinstance(v, list):
            v = [x.decode("utf-8", "replace") if isinstance(x, bytes) else
                 (float(f"{x:.6g}") if isinstance(x, float) else x) for x in v]
        elif isinstance(v, float):
            v = float(f"{v:.6g}")
        out[a.name] = v
    return out
