"""The optimizer: normalise, match, cost, select, rewrite, verify — phase by phase, each to a fixed point."""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx

from npufuse import FUSED_DOMAIN
from npufuse.errors import InputError, first_line
from npufuse.fusion.admit import admit
from npufuse.fusion.ascend import replacement_kernel
from npufuse.fusion.rewrite import apply
from npufuse.fusion.select import boundary_violation, select
from npufuse.fusion.subgraphs import fuse_subgraphs, has_subgraphs, subgraph_value_names
from npufuse.ir.candidates import Match, Refusal, Replacement
from npufuse.ir.collector import fewer_collections
from npufuse.ir.graph import QUANTIZATION_OPS, Graph
from npufuse.ir.modelio import check_structure
from npufuse.prepare.normalize import normalize_with_view
from npufuse.patterns import PATTERNS, fused_op_defs
from npufuse.patterns.base import Pattern
from npufuse.patterns.quantized import quantized_refusal
from npufuse.console.progress import Progress
from npufuse.verify import precision, selection
from npufuse.verify.compare import Comparison
from npufuse.verify.inputs import OTHER_DIM, check_dims, model_inputs, synthetic_value, unmatched_dims
from npufuse.verify.rewrite_check import RewriteCheck, check_rewrite, check_signature
from npufuse.ir import widen
from npufuse.verify.segments import DEFAULT_VERIFY_MEMORY_BYTES, ActivationStore, run_segmented
from npufuse.verify.whole import ModelCheck, compare_outputs

from npufuse.ir.candidates import APPLIED, DROPPED, ROLLED_BACK, SKIPPED_COST  # noqa: F401  (re-exported)


@dataclass
class OptimizeOptions:
    patterns: Sequence[Pattern] = PATTERNS
    spec: Any = None                  # an NpuSpec; None prices nothing and fuses every legal candidate
    force_fuse: bool = False          # fuse every legal candidate even where the cost model says no
    margin: float | None = None       # gain a fusion must exceed, a fraction of the time at stake (None: default)
    verify: bool = True
    dims: Mapping[str, int] | None = None   # values for symbolic dims (cost model and generated inputs)
    # values for symbolic dims in the generated inputs only, where they differ from the priced ones (`npufuse
    # report` prices at the user's --dim and verifies at small sizes); None: `dims`
    verify_dims: Mapping[str, int] | None = None
    seed: int = 0
    max_rounds: int = 8
    progress: Progress | None = None
    verify_memory_bytes: int = DEFAULT_VERIFY_MEMORY_BYTES  # weights one onnxruntime session may hold
    # keep the normalised model as it was before fusion (OptimizeResult.normalized): a report prices it whole,
    # and normalising the input again costs seconds on a big graph
    keep_normalized: bool = False

    @property
    def input_dims(self) -> Mapping[str, int] | None:
        """The dims the generated inputs (verification) use."""
        return self.dims if self.verify_dims is None else self.verify_dims


@dataclass
class FusionRecord:
    """One candidate and what became of it."""

    match: Match
    status: str
    reason: str = ""
    decision: Any = None              # FusionDecision or None
    check: RewriteCheck | None = None
    round: int = 0
    node_ops: tuple[str, ...] = ()    # op type of each matched node
    fused_ops: tuple[str, ...] = ()   # op type of each replacement node ("npufuse.FusedConv", "Conv", ...)
    ascend_kernel: dict[str, Any] | None = None   # the CANN kernel the region becomes (npu_model.ascend_kernels)
    graph: str = ""                   # the subgraph it lies in (fusion.subgraphs), "" for the main graph
    # a candidate refused only because no shipped kernel runs it: its replacement, kept for the kernel
    # opportunities a report lists (fusion.opportunities); None for every other record
    replacement: Replacement | None = None

    def to_dict(self, kernel_records: dict | None = None) -> dict[str, Any]:
        """JSON-safe plain values; `kernel_records`: see cost_model.decide.FusionDecision.to_dict."""
        decision = self.decision
        return {
            "pattern": self.match.pattern, "kind": self.match.kind, "status": self.status,
            "reason": self.reason, "nodes": list(self.match.nodes), "inputs": list(self.match.inputs),
            "outputs": list(self.match.outputs), "round": self.round, "node_ops": list(self.node_ops),
            "fused_ops": list(self.fused_ops), "ascend_kernel": self.ascend_kernel,
            "decision": None if decision is None else decision.to_dict() if kernel_records is None else
            decision.to_dict(kernel_records),
            "check": self.check.to_dict() if self.check is not None else None,
        } | ({"graph": self.graph} if self.graph else {})


@dataclass
class OptimizeResult:
    model: onnx.ModelProto
    records: list[FusionRecord] = field(default_factory=list)
    refusals: list[Refusal] = field(default_factory=list)
    model_check: ModelCheck | None = None
    timings_s: dict[str, float] = field(default_factory=dict)
    nodes_before: int = 0
    nodes_after: int = 0
    notes: list[str] = field(default_factory=list)   # things a person should know about this run
    verify_segments: int = 0          # segments the model was verified in (1: it fit the memory budget whole)
    canonical: dict[str, int] = field(default_factory=dict)   # canonicalisation rules applied (normalize)
    patterns_off: tuple[str, ...] = ()   # patterns not run (--only/--disable/--fusion-switch): their starts stay by choice
    # the normalised input before fusion and its inferred value types (OptimizeOptions.keep_normalized), else None
    normalized: tuple[onnx.ModelProto, dict[str, onnx.TypeProto]] | None = None

    @property
    def applied(self) -> list[FusionRecord]:
        return [r for r in self.records if r.status == APPLIED]

    @property
    def rolled_back(self) -> list[FusionRecord]:
        return [r for r in self.records if r.status == ROLLED_BACK]

    @property
    def ok(self) -> bool:
        """True unless the whole-model check ran and failed (drift, or inconclusive: see `inconclusive`)."""
        return self.model_check is None or self.model_check.ok

    @property
    def inconclusive(self) -> bool:
        """The whole-model check found no drift but could not verify: an output of the original is NaN/inf on the
        generated inputs, or every output is empty. The optimized model is not written (nothing vouches for it)."""
        return self.model_check is not None and self.model_check.inconclusive

    def absorbed_into(self) -> dict[int, int]:
        """{index of an applied record: index of the later applied record whose match took its fused node}: a Gelu
        fused in phase 0 and then taken into a FusedMatMul epilogue, a LayerNorm into an AddLayerNorm. A fused node
        keeps the name of one of the nodes it replaced, so a later match naming one of those nodes took it."""
        made_by: dict[tuple[str, str], int] = {}
        out: dict[int, int] = {}
        for i, r in enumerate(self.records):
            if r.status != APPLIED:
                continue
            for name in r.match.nodes:
                prev = made_by.get((r.graph, name))
                if prev is not None and prev != i:
                    out[prev] = i
                made_by[(r.graph, name)] = i
        return out

    def applied_by_kind(self) -> Counter:
        """Applied fusions whose fused node is in the output, per kind: one later absorbed into a bigger fusion
        counts there, not twice (see `absorbed_by_kind`)."""
        absorbed = self.absorbed_into()
        return Counter(r.match.kind for i, r in enumerate(self.records) if r.status == APPLIED and i not in absorbed)

    def absorbed_by_kind(self) -> Counter:
        """Applied fusions later absorbed into a bigger fusion (so not in the output as such), per kind."""
        return Counter(self.records[i].match.kind for i in self.absorbed_into())

    def refused_by_reason(self) -> Counter:
        c = Counter(f.reason for f in self.refusals)
        c.update(r.status if r.status != DROPPED else "overlap" for r in self.records
                 if r.status in (SKIPPED_COST, ROLLED_BACK, DROPPED))
        return c

    def worst_rewrite_error(self) -> Comparison | None:
        comps = [c for r in self.applied if r.check for c in r.check.comparisons]
        return max(comps, key=lambda c: c.min_passing_rtol, default=None)


def optimize(model: onnx.ModelProto, base_dir: str | None = None,
             options: OptimizeOptions | None = None) -> OptimizeResult:
    """Fuse what pays off and verifies; the input model is never modified.

    Weights flow as references (see `weights`): nothing here reads a weight no rewrite needs. Verification runs
    the model segment by segment under `opts.verify_memory_bytes` (see `verify.segments`): once on the normalised
    input, keeping every activation for the per-rewrite checks, and once on the result. The subgraphs of If, Loop
    and Scan nodes are fused after the main graph, each as a standalone model (see `fusion.subgraphs`)."""
    opts = options or OptimizeOptions()
    with fewer_collections():
        return _optimize(model, base_dir, opts)


def _optimize(model: onnx.ModelProto, base_dir: str | None, opts: OptimizeOptions) -> OptimizeResult:
    admit(model, frozenset(op for domain, op in fused_op_defs() if domain == FUSED_DOMAIN))
    progress = opts.progress or Progress.silent()
    timings: dict[str, float] = Counter()
    t0 = time.perf_counter()
    canonical: Counter = Counter()
    with progress.stage("normalize"):
        norm = normalize_with_view(model, base_dir, canonical)
    cur, types = norm.model, norm.types
    timings["normalize"] += time.perf_counter() - t0
    result = OptimizeResult(cur, nodes_before=len(model.graph.node), canonical=dict(canonical),
                            patterns_off=tuple(p.name for p in PATTERNS if p not in opts.patterns))

    if opts.keep_normalized:   # fusion changes `cur` in place
        kept = onnx.ModelProto()
        kept.CopyFrom(cur)
        result.normalized = (kept, dict(types))
    g: Graph = norm.view   # the view of `cur`: built once, patched by every rewrite
    check_dims(g, opts.dims)
    result.notes.extend(_assumed_dim_notes(g, opts))
    with ExitStack() as cleanup:
        verifier = None
        if opts.verify:
            t = time.perf_counter()
            # The reference is the model before the canonical rules: they are checked with the rewrites.
            verifier = _Verifier.start(g, opts, progress, cleanup, reference=norm.before_canonical)
            timings["verify_model"] += time.perf_counter() - t
        t = time.perf_counter()
        cost_shapes = _cost_shapes(cur, types, opts)
        timings["cost_select"] += time.perf_counter() - t
        run = _Run(opts, result, progress, timings, base_dir, verifier)
        nested = has_subgraphs(g)
        # A rewrite of the main graph may not introduce a name a subgraph uses (and vice versa, below).
        cur = _fuse(run, cur, types, cost_shapes, _Scope(reserved=subgraph_value_names(cur) if nested else set()), g)
        if nested:
            def fuse_standalone(model: onnx.ModelProto, sub_types: dict, where: str, activations: Any,
                                reserved: set[str]) -> onnx.ModelProto:
                return _fuse(run, model, sub_types, _cost_shapes(model, sub_types, opts),
                             _Scope(where, activations, reserved))

            fuse_subgraphs(cur, Graph(cur, base_dir, types), fuse_standalone, run)
        result.model = cur
        result.nodes_after = len(cur.graph.node)
        t = time.perf_counter()
        try:
            check_structure(cur)
        except Exception as exc:
            raise AssertionError(f"npufuse produced an invalid model: {exc}") from exc
        timings["checker"] += time.perf_counter() - t
        if verifier is not None and result.applied:
            t = time.perf_counter()
            result.model_check = verifier.compare_optimized(cur)
            timings["verify_model"] += time.perf_counter() - t
        if verifier is not None:
            result.notes.extend(verifier.notes)
            result.verify_segments = verifier.segments
    result.timings_s = dict(timings)
    return result


@dataclass
class _Run:
    """What every phase loop of one optimize run shares (the main graph's and each subgraph's)."""

    opts: OptimizeOptions
    result: OptimizeResult
    progress: Progress
    timings: dict[str, float]
    base_dir: str | None
    verifier: _Verifier | None


@dataclass
class _Scope:
    """Where a phase loop runs: the main graph (`where` ""), or a subgraph as a standalone model."""

    where: str = ""                  # the subgraph's path (see fusion.subgraphs); "" for the main graph
    activations: Any = None          # (g, names, rnd) -> values at rewrite boundaries; None: the verifier's own
    reserved: set[str] = field(default_factory=set)   # names used elsewhere in the model: no rewrite may make one


def _fuse(run: _Run, cur: onnx.ModelProto, types: dict, cost_shapes: Any, scope: _Scope,
          g: Graph | None = None) -> onnx.ModelProto:
    """Every phase to a fixed point on `cur` (changed in place and returned): match, build, price, select,
    check each rewrite, apply."""
    opts, result, progress, timings, verifier = run.opts, run.result, run.progress, run.timings, run.verifier
    where = scope.where
    rejected: set[tuple[str, tuple[str, ...]]] = set()
    seen_refusals: set[tuple[str, str, str]] = set()
    for phase in sorted({p.phase for p in opts.patterns}):
        patterns = [p for p in opts.patterns if p.phase == phase]
        label = f"match phase {phase}" + (f" in {where}" if where else "")
        with progress.stage(label, unit="rounds") as stage:
            for rnd in range(opts.max_rounds):
                stage.advance()
                t = time.perf_counter()
                if g is None:
                    g = Graph(cur, run.base_dir, types)
                    timings["index"] += time.perf_counter() - t
                t = time.perf_counter()
                matches, refusals = _match_all(g, patterns, rejected)
                for f in refusals:
                    key = (f.pattern, f.node, f.reason)
                    if key not in seen_refusals:
                        seen_refusals.add(key)
                        result.refusals.append(dataclasses.replace(f, graph=where) if where else f)
                timings["match"] += time.perf_counter() - t
                if not matches:
                    break
                t = time.perf_counter()
                built = _build_all(g, patterns, matches, result, rejected, scope)
                timings["rewrite"] += time.perf_counter() - t
                t = time.perf_counter()
                ranked = _price_and_rank(g, built, opts, cost_shapes, result, rejected, rnd, where)
                selected, dropped = select(g, [m for m, _, _ in ranked])
                timings["cost_select"] += time.perf_counter() - t
                rep_of = {m: rep for m, rep, _ in ranked}
                for m, why in dropped:
                    result.records.append(_record(g, m, rep_of[m], DROPPED, why, rnd=rnd, spec=opts.spec, where=where))
                selected_set = set(selected)
                chosen = [(m, rep, dec) for m, rep, dec in ranked if m in selected_set]
                t = time.perf_counter()
                if verifier:
                    g.write_nodes()   # a capture runs the current model
                kept = verifier.check_rewrites(g, chosen, result, rejected, rnd, where, scope.activations) \
                    if verifier else [(m, rep, dec, None) for m, rep, dec in chosen]
                timings["verify_rewrites"] += time.perf_counter() - t
                if not kept:
                    break
                # Records first: the rewrite below replaces the nodes `g` points at.
                for m, rep, dec, chk in kept:
                    result.records.append(_record(g, m, rep, APPLIED, dec.reason if dec is not None else "",
                                                  dec, chk, rnd, opts.spec, where))
                    if scope.reserved:
                        scope.reserved.update(_new_names(g, m, rep))
                t = time.perf_counter()
                cur = apply(g, [(m, rep) for m, rep, _, _ in kept])   # patches the view: it is never rebuilt
                timings["rewrite"] += time.perf_counter() - t
    if g is not None:
        t = time.perf_counter()
        g.write_nodes()   # the rounds patched the view; the model's node list is written once, here
        timings["rewrite"] += time.perf_counter() - t
    return cur


def _cost_shapes(model: onnx.ModelProto, types: dict, opts: OptimizeOptions) -> Any:
    if opts.spec is None:
        return None
    from npufuse.fusion.costing import CostShapes  # the cost model is only loaded when a target is set

    return CostShapes(model, opts.dims, types=types)


def _assumed_dim_notes(g: Graph, opts: OptimizeOptions) -> list[str]:
    """One note per input symbol no default's name fits: the sizes it was given are guesses the user should see."""
    notes = []
    for d in unmatched_dims(g, opts.dims):
        sizes = []
        if opts.spec is not None:
            from npufuse.fusion.costing import COST_OTHER_DIM

            sizes.append(f"priced at {COST_OTHER_DIM}")
        if opts.verify:
            sizes.append(f"verified at {OTHER_DIM}")
        if sizes:
            notes.append(f"symbolic dim {d!r} matches no known dim name (batch, sequence/seq/len, past, height, "
                         f"width): {' and '.join(sizes)}; set it with --dim {d}=INT")
    return notes


def _new_names(g: Graph, m: Match, rep: Replacement) -> set[str]:
    """The value names a replacement introduces (folded weights, values between its nodes)."""
    had = {o for n in m.nodes for o in g.node(n).output}
    return {o for n in rep.nodes for o in n.output if o and o not in had} | \
        {t.name for t in rep.initializers if t.name not in g.initializers}


class _Verifier:
    """Verification state for one run: the seeded inputs, the original's outputs, and every activation of the
    original (kept in RAM up to a limit, spilled to a temp folder beyond) for the per-rewrite checks."""

    def __init__(self, base_dir: str | None, opts: OptimizeOptions, progress: Progress,
                 feeds: dict[str, np.ndarray], store: ActivationStore) -> None:
        self.base_dir, self.opts, self.progress = base_dir, opts, progress
        self.feeds, self.store = feeds, store
        self.reference_outputs: dict[str, np.ndarray] = {}
        self.checks: dict[str, tuple[str, RewriteCheck]] = {}   # signature -> (first node, verdict)
        self.notes: list[str] = []
        self.segments = 0
        # Values the replacements introduced: their names may not mean what they meant in the original.
        self.rewritten: set[str] = set()
        # The reference model, kept where an output is float16: an fp32 run of it settles a whole-model difference
        # plain fp16 tolerance cannot tell from rounding (verify.precision); the view's model changes in place.
        self.exact_source: onnx.ModelProto | None = None

    @classmethod
    def start(cls, g: Graph, opts: OptimizeOptions, progress: Progress, cleanup: ExitStack,
              reference: onnx.ModelProto | None = None) -> _Verifier:
        """Run the reference (`reference`, else the model `g` views) once, keeping its outputs and every
        activation: the canonical rules keep each surviving name's value, so they serve `g`'s model too."""
        feeds = model_inputs(g, opts.seed, opts.input_dims)
        # Activations kept in RAM scale with the memory the user allows (a quarter of it, at most 256 MiB);
        # the rest spill to disk and come back memory-mapped.
        store = cleanup.enter_context(ActivationStore(memory_bytes=min(256 << 20, opts.verify_memory_bytes // 4)))
        v = cls(g.base_dir, opts, progress, feeds, store)
        if widen.mentions_bf16(g.model):
            v.notes.append(widen.NOTE)
        try:  # the input model must run before anything can be checked against it
            v.reference_outputs = v._run(reference if reference is not None else g.model, "verify original",
                                         capture="all")
        except Exception as exc:
            raise InputError(f"onnxruntime cannot run the input model on generated inputs ({first_line(exc)}); "
                             "fix the model, set symbolic sizes with --dim, or pass --no-verify") from None
        if any(precision.is_low_precision(np.asarray(a).dtype) for a in v.reference_outputs.values()):
            v.exact_source = onnx.ModelProto()
            v.exact_source.CopyFrom(reference if reference is not None else g.model)   # weights are references
        return v

    def _run(self, model: onnx.ModelProto, stage_name: str, capture: Any = ()) -> dict[str, np.ndarray]:
        plan_total = [0]
        with self.progress.stage(stage_name, unit="segments") as stage:
            def report(done: int, total: int) -> None:
                plan_total[0] = total
                stage.update(done, total)

            out = run_segmented(model, self.feeds, self.base_dir, self.opts.verify_memory_bytes, capture,
                                self.store, report)
        self.segments = max(self.segments, plan_total[0])
        return out

    def activations(self, g: Graph, names: list[str], rnd: int) -> dict[str, np.ndarray]:
        """The values `names` take in the current model: the original's captured activations where the name
        existed there (a kept rewrite preserves every value outside it), else a segmented run of the current
        model."""
        values = {v: self.feeds[v] for v in names if v in self.feeds}
        missing = []
        for v in names:
            if v not in values:
                arr = self.store.get(v) if v not in self.rewritten else None
                if arr is not None:
                    values[v] = arr
                else:
                    missing.append(v)
        if missing:
            try:
                self._run(g.model, f"capture round {rnd + 1}", capture=missing)
                values.update({v: self.store.get(v) for v in missing if v in self.store})
            except Exception as exc:
                self.notes.append(f"round {rnd + 1}: could not capture the model's real activations "
                                  f"({first_line(exc, 160)}); rewrites were checked on synthetic inputs")
        rng = np.random.default_rng(self.opts.seed + 1)
        for v in names:
            if v not in values:
                arr = synthetic_value(g, v, rng, self.opts.input_dims)
                if arr is not None:
                    values[v] = arr
        return values

    def check_rewrites(self, g: Graph, chosen: list, result: OptimizeResult, rejected: set, rnd: int,
                       where: str = "", activations: Any = None) -> list:
        """Check each chosen rewrite on the activations at its boundary (`activations`: where a subgraph's come
        from, see fusion.subgraphs); rewrites with the same signature (the repeated layers of a transformer) share
        one check."""
        boundary = list(dict.fromkeys(v for m, _, _ in chosen for v in m.inputs if not g.is_constant(v)))
        values = (activations or self.activations)(g, boundary, rnd)
        kept = []
        with self.progress.stage(f"check rewrites (round {rnd + 1})", len(chosen), "rewrites") as stage:
            for m, rep, dec in chosen:
                sig = check_signature(g, m, rep, values)
                if sig is not None and sig in self.checks:
                    first, verdict = self.checks[sig]
                    chk = RewriteCheck(verdict.ok, verdict.comparisons, verdict.reason, shared_with=first,
                                       inconclusive=verdict.inconclusive)
                else:
                    chk = check_rewrite(g, m, rep, values)
                    if sig is not None:
                        self.checks[sig] = (m.nodes[0], chk)
                stage.advance()
                if chk.ok:
                    kept.append((m, rep, dec, chk))
                    self.rewritten.update(o for n in rep.nodes for o in n.output if o and o not in m.outputs)
                else:
                    rejected.add((m.pattern, m.nodes))
                    result.records.append(_record(g, m, rep, ROLLED_BACK, chk.reason, dec, chk, rnd, self.opts.spec,
                                                  where))
        return kept

    def compare_optimized(self, optimized: onnx.ModelProto) -> ModelCheck:
        """The whole optimized model against the original's outputs, segment by segment."""
        try:
            got = self._run(optimized, "verify optimized")
        except Exception as exc:
            return ModelCheck(False, reason=f"onnxruntime could not run the optimized model: {first_line(exc)}")
        check = precision.settle(compare_outputs(got, self.reference_outputs), got, self.reference_outputs,
                                 self._exact_outputs)
        settled = [c.name for c in check.comparisons if c.ok and c.detail.startswith(precision.SETTLED)]
        if settled:
            self.notes.append(f"float16 output(s) {', '.join(settled)} differ from the original's beyond fp16 "
                              "tolerance, and are as close to an fp32 run of the original as fp16 rounding allows: "
                              "not drift (docs/optimize-report.md)")
        check, note = selection.settle(
            check, optimized, self.feeds, self.reference_outputs,
            lambda name: self.store.get(name) if name not in self.rewritten and name in self.store else None,
            lambda model, feeds: run_segmented(model, feeds, self.base_dir, self.opts.verify_memory_bytes))
        if note:
            self.notes.append(note)
        return check

    def _exact_outputs(self) -> dict[str, np.ndarray] | None:
        """The reference model's outputs computed in float32 (verify.precision), None where it cannot be widened."""
        model = precision.fp32_copy(self.exact_source) if self.exact_source is not None else None
        if model is None:
            return None
        # the fp16 weights are read and cast to fp32 inside each segment: a third of the budget keeps its peak
        return run_segmented(model, precision.widen_feeds(self.feeds), self.base_dir,
                             max(1, self.opts.verify_memory_bytes // 3))


def _record(g: Graph, m: Match, rep: Replacement | None, status: str, reason: str, dec: Any = None,
            chk: RewriteCheck | None = None, rnd: int = 0, spec: Any = None, where: str = "") -> FusionRecord:
    fused = tuple(f"{n.domain}.{n.op_type}" if n.domain else n.op_type for n in rep.nodes) if rep else ()
    by_name = g.node_by_name
    node_ops = tuple(by_name[n].op_type for n in m.nodes)
    kernel = replacement_kernel(g, m, rep, spec, node_ops) if rep is not None else None
    kept = rep if status == SKIPPED_COST and getattr(dec, "unsupported", "") else None
    return FusionRecord(m, status, reason, dec, chk, rnd, node_ops, fused, kernel, where, kept)


def _match_all(g: Graph, patterns: Sequence[Pattern], rejected: set) -> tuple[list[Match], list[Refusal]]:
    by_anchor: dict[str, list[Pattern]] = {}
    for p in patterns:
        for op in p.anchor_ops:
            by_anchor.setdefault(op, []).append(p)
    matches: list[Match] = []
    refusals: list[Refusal] = []
    # A graph without a quantization step has no QDQ group to refuse (asking costs a walk per anchor).
    quantized = any(g.names_by_op.get(op) for op in QUANTIZATION_OPS)
    for node in g.nodes_of(by_anchor):   # the anchors, in topological order
        for p in by_anchor[node.op_type]:
            r = p.match(g, node)
            # Quantized (QDQ) groups stay as they are, each a near-miss naming its quantization node.
            if quantized:
                r = quantized_refusal(g, p.name, node, r) or r
            if r is None:
                continue
            if isinstance(r, Refusal):
                refusals.append(r)
                continue
            if (r.pattern, r.nodes) in rejected:
                continue
            why = boundary_violation(g, r)
            if why is not None:
                refusals.append(Refusal(r.pattern, r.nodes[0], "not-convex", why, r.nodes))
                continue
            matches.append(r)
    return matches, refusals


def _build_all(g: Graph, patterns: Sequence[Pattern], matches: list[Match], result: OptimizeResult,
               rejected: set, scope: _Scope) -> list[tuple[Match, Replacement]]:
    by_name = {p.name: p for p in patterns}
    built = []
    for m in matches:
        pattern = by_name[m.pattern]
        try:
            rep = pattern.build(g, m)
            clash = sorted(_new_names(g, m, rep) & scope.reserved) if scope.reserved else ()
            if clash:  # a name the view cannot see (another scope of the model) must not be defined twice
                raise ValueError(f"the replacement would define {clash[0]!r}, a name used elsewhere in the model")
            built.append((m, rep))
        except (ValueError, NotImplementedError) as exc:
            rejected.add((m.pattern, m.nodes))
            result.refusals.append(Refusal(m.pattern, m.nodes[0], "build-failed", str(exc), m.nodes, scope.where))
    return built


def _price_and_rank(g: Graph, built: list[tuple[Match, Replacement]], opts: OptimizeOptions, cost_shapes: Any,
                    result: OptimizeResult, rejected: set, rnd: int,
                    where: str = "") -> list[tuple[Match, Replacement, Any]]:
    ranked = []
    for m, rep in built:
        dec = None
        if opts.spec is not None:
            from npufuse.fusion.costing import (
                price,  # the cost model is only loaded when a target is set
            )
            dec = price(g, m, rep, opts.spec, opts.force_fuse, cost_shapes, opts.margin)
        if dec is not None and not dec.fuse:
            rejected.add((m.pattern, m.nodes))
            result.records.append(_record(g, m, rep, SKIPPED_COST, dec.reason, dec, rnd=rnd, spec=opts.spec,
                                          where=where))
            continue
        ranked.append((m, rep, dec))
    order = {p.name: i for i, p in enumerate(opts.patterns)}
    ranked.sort(key=lambda t: (-(t[2].gain_us if t[2] is not None else 0.0),
                               min(g.topo_index[n] for n in t[0].nodes), order.get(t[0].pattern, 99)))
    return ranked


def require_patterns(names: Sequence[str] | None, disabled: Sequence[str] | None) -> list[Pattern]:
    """The patterns to run after --only/--disable; unknown names are a usage error."""
    known = {p.name: p for p in PATTERNS}
    for n in list(names or []) + list(disabled or []):
        if n not in known:
            raise InputError(f"unknown pattern {n!r}; known patterns: {', '.join(known)}")
    chosen = [p for p in PATTERNS if not names or p.name in names]
    return [p for p in chosen if p.name not in set(disabled or [])]
