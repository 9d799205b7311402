"""The ATC form of an optimized model: what CANN's ONNX parser (ATC) reads on the released GE versions.

From the ONNX form (fused ops in domain `npufuse` with model-local function bodies):

1. every fused node whose CANN kernel has an ONNX plugin, and whose attributes that plugin can express on the
   target chip, becomes the plugin node (`regions.map_region`; the others keep a stable reason);
2. every other fused node is inlined: its function body, standard ops in the canonical form npufuse proved, for
   ATC's own fusion passes (`lower.inline_functions`);
3. the default domain moves to one opset ATC registers every op at (<= 18), and ops with no key at any version
   are decomposed (`lower.convert_default_opset`);
4. the form is chosen per model (released GE: one opset import when no plugin node is left, else the literal
   `ai.onnx` import beside `npu` with every standard node's domain written out; `head`: `{"": N, "npu": 1}`);
5. the offline pre-check (`precheck.atc_problems`) must find nothing, or nothing is written.

Weights are never read: initializers (with their external-data references) move from the input model to the
output untouched; the only tensors made here are masks and 0-element placeholders.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import onnx
from onnx import helper

from npufuse import FUSED_DOMAIN
from npufuse.emit.atc.lower import LoweringError, convert_default_opset, inline_functions, rebuilt
from npufuse.emit.atc.precheck import AtcProblem, atc_problems, refused
from npufuse.emit.atc.regions import NPU_DOMAIN, Namer, PluginRegion, StaysStandard, Values, map_region
from npufuse.emit.atc.keys import make_key
from npufuse.errors import InputError
from npufuse.ir.graph import attributes
from npufuse.ir.walk import graphs_below
from npufuse.npu_model.user_kernels import UserKernel

ATC_MAX_OPSET = 18
ATC_MIN_OPSET = 14
LITERAL_DEFAULT_DOMAIN = "ai.onnx"
DOC = "docs/atc.md"


@dataclass(frozen=True)
class RegionForm:
    """What one fused node of the ONNX form became in the ATC form."""

    node: str                 # the fused node's name
    op_type: str              # npufuse op
    plugin: str | None        # the plugin node's op type (NPUPromptFlashAttention, ...) or None
    kernel: str | None        # the CANN kernel it reaches, or None where ATC's passes decide
    reason: str | None        # why it stayed standard ops (stable key), None for a plugin
    detail: str | None

    def to_json(self) -> dict[str, Any]:
        return {"node": self.node, "op_type": self.op_type, "plugin": self.plugin, "kernel": self.kernel,
                "reason": self.reason, "detail": self.detail}


@dataclass
class AtcForm:
    """The ATC form of a model, how it was chosen, and what each fused region became."""

    model: onnx.ModelProto
    opset: int
    form: str                                 # single-import | literal-ai.onnx+npu | default+npu
    ge: str
    regions: list[RegionForm] = field(default_factory=list)
    # by node name, the reference kernel of each user plugin node (`--kernels`): its npufuse op's, with the fused
    # node's attributes (what the user's kernel declares it computes), for the ATC form's verification
    user_nodes: dict[str, Any] = field(default_factory=dict)

    def counts(self) -> dict[str, int]:
        """Kernels reached through plugins, and regions left to ATC's passes, by reason."""
        out: Counter = Counter()
        for r in self.regions:
            out[f"plugin:{r.kernel}" if r.plugin else f"standard:{r.reason}"] += 1
        return dict(sorted(out.items()))

    def summary_line(self) -> str:
        plugins = Counter(r.kernel for r in self.regions if r.plugin)
        standard = sum(1 for r in self.regions if not r.plugin)
        through = ", ".join(f"{n} {k}" for k, n in sorted(plugins.items())) or "none"
        return (f"ATC form ({self.form}, opset {self.opset}, GE {self.ge}): kernels through plugins: {through}; "
                f"{standard} fused regions written as standard ops for ATC's passes")

    def to_json(self) -> dict[str, Any]:
        return {"form": self.form, "opset": self.opset, "ge": self.ge, "counts": self.counts(),
                "regions": [r.to_json() for r in self.regions]}


class AtcEmitError(InputError):
    """A model ATC cannot take, whatever npufuse does (exit 2; nothing written)."""


def _values(model: onnx.ModelProto, types: Mapping[str, onnx.TypeProto], chip: str | None,
            precision_mode: str | None = None) -> Values:
    shapes: dict[str, tuple | None] = {}
    elems: dict[str, int] = {}
    for name, t in types.items():
        tt = t.tensor_type
        elems[name] = tt.elem_type
        # fixed dims as ints, symbolic ones by name (two values with the same named dims have one shape)
        shapes[name] = (tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim)
                        if tt.HasField("shape") else None)
    for init in model.graph.initializer:
        elems.setdefault(init.name, init.data_type)
        shapes.setdefault(init.name, tuple(int(d) for d in init.dims))
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)
    return Values(shapes, elems, opset, chip, precision_mode)


def target_opset(model_opset: int) -> int:
    """The default-domain opset of the ATC form: the model's own where ATC registers it, else the nearest one."""
    return max(ATC_MIN_OPSET, min(model_opset, ATC_MAX_OPSET))


def to_atc(model: onnx.ModelProto, types: Mapping[str, onnx.TypeProto], chip: str | None, *,
           ge: str = "released", plugins: bool = True, user_kernels: Sequence[UserKernel] = (),
           precision_mode: str | None = None) -> AtcForm:
    """The ATC form of `model` (the ONNX form npufuse writes), for `chip` (a CANN chip name, None: no chip limits).

    `types` are the value types of the ONNX form (onnx shape inference: fixed dims as ints). `plugins=False`
    writes every region as standard ops. `user_kernels` (`--kernels`): a region one of them runs becomes the node
    its `[kernel.atc]` declares, in its own domain, and that key counts as registered. `precision_mode`: ATC's
    --precision_mode the form will be compiled under (a float32 region may reach a kernel that has only float16
    where the mode lowers it; None: the dtypes as they are). Raises AtcEmitError (one line: the first node ATC refuses, how many, and
    `npufuse atc-check` for the list) when the result still would not parse; nothing is changed in `model`."""
    values = _values(model, types, chip, precision_mode)
    taken = {n.name for n in model.graph.node} | {v for n in model.graph.node for v in (*n.input, *n.output)}
    taken |= {t.name for t in model.graph.initializer}
    fresh = Namer(taken)
    regions: list[RegionForm] = []
    replaced: dict[str, PluginRegion] = {}
    user_nodes: dict[str, Any] = {}
    user_names = {k.name for k in user_kernels if k.atc is not None}
    for node in model.graph.node:
        if node.domain != FUSED_DOMAIN:
            continue
        got = map_region(node, values, fresh, user_kernels) if plugins else \
            StaysStandard("plugins-off", "--atc-plugins off")
        if isinstance(got, PluginRegion):
            replaced[node.name] = got
            if got.kernel in user_names:
                user_nodes[node.name] = _user_reference(node)
            # the plugin node: layout helpers in standard ops may come before or after it
            plugin = next(n.op_type for n in got.nodes if n.domain not in ("", "ai.onnx"))
            regions.append(RegionForm(node.name, node.op_type, plugin, got.kernel, None, None))
        else:
            regions.append(RegionForm(node.name, node.op_type, None, None, got.reason, got.detail))
    # Fused nodes inside an If / Loop / Scan body: written back as standard ops (their bodies inlined below); no
    # plugin node is placed in a subgraph, where ATC's parser takes fewer forms (emit/atc/precheck.py)
    for sub in graphs_below(model.graph):
        if sub is model.graph:
            continue
        for node in sub.node:
            if node.domain == FUSED_DOMAIN:
                regions.append(RegionForm(node.name, node.op_type, None, None, "in-subgraph",
                                          f"inside the subgraph {sub.name!r}: written as standard ops"))
    # 1. plugin nodes in place of their fused nodes (a new model around the same initializers)
    nodes: list[onnx.NodeProto] = []
    for node in model.graph.node:
        region = replaced.get(node.name)
        nodes.extend(region.nodes if region else [node])
    # shape inference reads the plugin nodes' domain from the imports (their outputs stay unknown)
    user_domains = {k.atc.domain: k.atc.version for k in user_kernels if k.atc is not None}
    extra = {d: v for d, v in user_domains.items() if d != NPU_DOMAIN}
    opsets = [*model.opset_import, *([helper.make_opsetid(NPU_DOMAIN, 1)] if replaced else []),
              *(helper.make_opsetid(d, v) for d, v in sorted(extra.items()))]
    staged = rebuilt(model, nodes, in_place=False, opset_import=opsets,
                     initializers=[t for r in replaced.values() for t in r.initializers])
    # 2. every other fused node becomes its body; 3. one opset ATC registers
    inlined = inline_functions(staged, in_place=True)
    _declare_types(inlined)
    user_keys = frozenset(make_key(k.atc.domain, k.atc.version, k.atc.op_type) for k in user_kernels
                          if k.atc is not None)
    # The model's own opset first; where ATC would refuse the form there, the nearest other opset it reads. ATC
    # registers an op at a run of opsets that need not reach 18: ReduceL2 has keys at ai.onnx 8..17 only, so a dynamo
    # export at 18 with a ReduceL2 (ConvNeXt-V2's GRN) parses at 17. Lower opsets first (the exporters' ops were all
    # there), then higher ones. `inlined` is kept for the retries: its weights are references, so each lowering
    # copies the structure only.
    own = target_opset(values.opset)
    first_problems: list[AtcProblem] | None = None
    for opset in (own, *range(own - 1, ATC_MIN_OPSET - 1, -1), *range(own + 1, ATC_MAX_OPSET + 1)):
        try:
            lowered = convert_default_opset(inlined, opset)
        except LoweringError:
            if opset == own:
                raise
            continue
        form = _set_form(lowered, opset, bool(replaced), ge, extra)
        problems = [p for p in atc_problems(lowered, ge, user_keys) if p.severity == "error"]
        if not refused(problems):
            return AtcForm(lowered, opset, form, ge, regions, user_nodes)
        if first_problems is None:
            first_problems = problems
    raise AtcEmitError(_refusal_line(first_problems or []))


def _user_reference(node: onnx.NodeProto) -> Any:
    """The user plugin node's kernel for verification: the reference kernel of the npufuse op it implements."""
    from npufuse.patterns import fused_op_defs

    op = fused_op_defs()[(FUSED_DOMAIN, node.op_type)]
    attrs = attributes(node)
    return lambda inputs: op.reference(inputs, attrs)


def _declare_types(model: onnx.ModelProto) -> None:
    """Value types of the inlined bodies' values (a decomposition needs the type of what it reads: Gelu's
    constants are made in x's type), from onnx shape inference, as value_info."""
    from npufuse.prepare.infer import infer_value_types

    g = model.graph
    known = {v.name for v in (*g.value_info, *g.input, *g.output)}
    for name, t in infer_value_types(model).items():
        if name not in known:
            vi = g.value_info.add()
            vi.name = name
            vi.type.CopyFrom(t)


def _set_form(model: onnx.ModelProto, opset: int, has_plugins: bool, ge: str,
              user_domains: Mapping[str, int] | None = None) -> str:
    """Write the opset imports and node domains of the form ATC reads (see the module doc). `user_domains`: the
    domains (and versions) of the user's plugin nodes other than npu, imported as they are."""
    user_domains = dict(user_domains or {})
    # A domain neither standard nor npu that nodes still use (an onnxruntime com.microsoft op the input held) keeps
    # its import: ATC refuses the node for what it is (no plugin registers its key), not for a missing import.
    used = {n.domain for g in graphs_below(model.graph) for n in g.node}
    for o in model.opset_import:
        if o.domain in used and o.domain not in ("", "ai.onnx", LITERAL_DEFAULT_DOMAIN, NPU_DOMAIN):
            user_domains.setdefault(o.domain, o.version)
    del model.opset_import[:]
    model.opset_import.extend(helper.make_opsetid(d, v) for d, v in sorted(user_domains.items()))
    if not has_plugins:
        model.opset_import.append(helper.make_opsetid("", opset))
        _set_domains(model.graph, "", "")
        return "single-import"
    if ge == "head":
        model.opset_import.extend([helper.make_opsetid("", opset), helper.make_opsetid(NPU_DOMAIN, 1)])
        _set_domains(model.graph, "", NPU_DOMAIN)
        return "default+npu"
    # Released GE looks the opset_import domain string up verbatim and refuses empty-domain nodes beside a second
    # import (E16005): spell the default domain out, on the import and on every standard node.
    model.opset_import.extend([helper.make_opsetid(LITERAL_DEFAULT_DOMAIN, opset), helper.make_opsetid(NPU_DOMAIN, 1)])
    _set_domains(model.graph, LITERAL_DEFAULT_DOMAIN, NPU_DOMAIN)
    return "literal-ai.onnx+npu"


def _set_domains(graph: onnx.GraphProto, standard: str, npu: str) -> None:
    for n in graph.node:
        if n.domain == NPU_DOMAIN:
            n.domain = npu          # plugin nodes (CANN's, or a user kernel's declared in npu)
        elif n.domain in ("", LITERAL_DEFAULT_DOMAIN):
            n.domain = standard
        # any other domain is a user plugin's own, kept as declared
        for a in n.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                _set_domains(a.g, standard, npu)
            elif a.type == onnx.AttributeProto.GRAPHS:
                for g in a.graphs:
                    _set_domains(g, standard, npu)


def _refusal_line(problems: list[AtcProblem]) -> str:
    first = problems[0]
    where = f"node {first.node!r} ({first.op_type})" if first.node else first.op_type or "the model"
    more = f" and {len(problems) - 1} more" if len(problems) > 1 else ""
    return (f"ATC would refuse the converted model: {where}: {first.code} {first.message}{more}; nothing written. "
            f"Run `npufuse atc-check MODEL` for the full list ({DOC})")
