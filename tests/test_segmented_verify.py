"""Segment-by-segment verification inside `optimize`: the same verdict as whole-model verification, drift in the
last segment caught, per-rewrite checks shared across repeated layers (failures included), a spilling activation
store, and input files left untouched.

Models: a Llama-style graph with real random weights in an external data file, written at test time by
`tools/make_llm_graphs.py` (which needs only numpy and onnx), and the committed TorchScript BERT export."""

from __future__ import annotations

import hashlib
import importlib.util
import math
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

import npufuse.fusion.engine as engine
from npufuse.cli import main
from npufuse.fusion.engine import OptimizeOptions, optimize
from npufuse.ir.graph import Graph, _node_value_inputs
from npufuse.ir.modelio import check_structure, load_model, model_dir
from npufuse.verify.inputs import model_inputs
from npufuse.verify.rewrite_check import RewriteCheck
from npufuse.verify.segments import ActivationStore, plan_segments, run_segmented
from npufuse.verify.whole import compare_models
from npufuse.ir.weights import tensor_nbytes

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures"
LAYERS = 4
HUGE = 1 << 40           # every model here fits one session
TINY = 1                 # every node that reads a weight starts a segment of its own


def _load_tool():
    spec = importlib.util.spec_from_file_location("_npufuse_make_llm_graphs", REPO / "tools" / "make_llm_graphs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    """4 layers, hidden 64 (GQA: 4 heads, 2 kv heads), random weights, every weight over 1 KiB in llama.onnx.data."""
    path = tmp_path_factory.mktemp("llama") / "llama.onnx"
    _load_tool().make_llama_graph(path, layers=LAYERS, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=100,
                                  dtype="float32", weights="random", external=True, seed=0)
    model = onnx.load(str(path), load_external_data=False)
    assert sum(t.data_location == TensorProto.EXTERNAL for t in model.graph.initializer) >= 7 * LAYERS
    return path


MODELS = {"llama": None, "bert": FIXTURES / "bert_ts17.onnx"}


@pytest.fixture(params=sorted(MODELS))
def model_path(request, llama) -> Path:
    return llama if request.param == "llama" else MODELS[request.param]


def _opt(path: Path, memory: int, **kw):
    return optimize(load_model(path), model_dir(path), OptimizeOptions(verify_memory_bytes=memory, **kw))


def _records(result) -> list[tuple]:
    return [(r.status, r.match.pattern, r.match.kind, r.match.nodes, r.fused_ops) for r in result.records]


def _feeds(model: onnx.ModelProto, base_dir: str) -> dict[str, np.ndarray]:
    return model_inputs(Graph(model, base_dir), seed=0)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _last_fused(model: onnx.ModelProto) -> int:
    return max(i for i, n in enumerate(model.graph.node) if n.domain == "npufuse")


def _tail_budget(model: onnx.ModelProto, pos: int) -> int:
    """The weight bytes read by node `pos` and every node after it: with this budget the node starts (or joins)
    the last segment, and everything before it is cut into segments of its own."""
    sizes = {t.name: tensor_nbytes(t) for t in model.graph.initializer}
    read = {v for n in model.graph.node[pos:] for v in _node_value_inputs(n) if v in sizes}
    return sum(sizes[v] for v in read)


def _target_record(result):
    """The applied rewrite whose replacement is the last fused node of the optimized model."""
    out = result.model.graph.node[_last_fused(result.model)].output[0]
    return [r for r in result.applied if out in r.match.outputs][-1]


# ---- 1. segmented verification == whole-model verification ------------------------------------------------------

def test_segmented_verdict_equals_whole_model_verdict(model_path):
    small, whole = _opt(model_path, TINY), _opt(model_path, HUGE)

    assert whole.verify_segments == 1
    n_layers = LAYERS if model_path.name == "llama.onnx" else 2
    assert small.verify_segments >= len(plan_segments(small.model, TINY)) > 3 * n_layers
    # The same candidates, the same fate: applied, rolled back, dropped, in the same order.
    assert _records(small) == _records(whole)
    assert len(small.applied) >= 3 * n_layers and not small.rolled_back
    assert small.ok and whole.ok and small.model_check.ok and whole.model_check.ok
    a, b = small.model_check.comparisons, whole.model_check.comparisons
    assert [c.name for c in a] == [c.name for c in b] == [o.name for o in small.model.graph.output]
    for ca, cb in zip(a, b):
        assert math.isfinite(ca.max_abs_err)
        assert ca.max_abs_err == pytest.approx(cb.max_abs_err, rel=1e-6, abs=0.0)
    # The per-rewrite checks saw the same activations (captured segment by segment vs in one session).
    for ra, rb in zip(small.records, whole.records):
        if ra.check is not None:
            assert [c.max_abs_err for c in ra.check.comparisons] == [c.max_abs_err for c in rb.check.comparisons]
            assert ra.check.shared_with == rb.check.shared_with
    # Segmentation changes no number: both models' outputs are bit-identical split into >1 segments or whole
    # (onnxruntime runs with graph optimizations off, so each op is the same kernel either way).
    original, base = load_model(model_path), model_dir(model_path)
    feeds = _feeds(original, base)
    for m in (original, small.model):
        assert len(plan_segments(m, TINY)) > 1
        seg, one = run_segmented(m, feeds, base, TINY), run_segmented(m, feeds, base, HUGE)
        assert seg.keys() == one.keys() and seg
        for k in seg:
            np.testing.assert_array_equal(seg[k], one[k])


# ---- 2. drift in the last segment is caught ----------------------------------------------------------------------

def _scale_output(nodes, scale_name: str, out: str) -> None:
    """Rewire the node producing `out` to `out`__raw and append `out` = `out`__raw * scale (in place)."""
    producer = next(n for n in nodes if out in n.output)
    raw = out + "__raw"
    producer.output[list(producer.output).index(out)] = raw
    nodes.append(helper.make_node("Mul", [raw, scale_name], [out], name=out + "__tamper"))


def _tamper_function(model: onnx.ModelProto, pos: int) -> onnx.ModelProto:
    """A copy whose node `pos` calls a private copy of its function with the first output scaled by 1.01."""
    bad = onnx.ModelProto()
    bad.CopyFrom(model)
    node = bad.graph.node[pos]
    fn = next(f for f in bad.functions
              if (f.domain, f.name, f.overload) == (node.domain, node.op_type, node.overload))
    new = bad.functions.add()
    new.CopyFrom(fn)
    new.overload = (fn.overload or "x") + "__tampered"
    body = list(new.node)
    body.append(helper.make_node("Constant", [], ["__tamper_scale"],
                                 value=numpy_helper.from_array(np.array(1.01, np.float32))))
    _scale_output(body, "__tamper_scale", new.output[0])
    del new.node[:]
    new.node.extend(body)
    node.overload = new.overload
    return bad


def _tamper_weight(model: onnx.ModelProto, pos: int, base_dir: str) -> onnx.ModelProto:
    """A copy whose node `pos` reads a perturbed copy of its first float weight (embedded, new name)."""
    bad = onnx.ModelProto()
    bad.CopyFrom(model)
    node = bad.graph.node[pos]
    inits = {t.name: t for t in bad.graph.initializer}
    name = next(v for v in node.input if v in inits and inits[v].data_type == TensorProto.FLOAT
                and math.prod(inits[v].dims) > 1)
    arr = numpy_helper.to_array(inits[name], base_dir)   # the original bytes, wherever they lie
    bad.graph.initializer.append(numpy_helper.from_array((arr * 1.05 + 0.05).astype(np.float32), name + "__tampered"))
    node.input[list(node.input).index(name)] = name + "__tampered"
    return bad


@pytest.mark.parametrize("how", ["function", "weight"])
def test_compare_models_catches_a_broken_last_fused_node(model_path, how):
    base = model_dir(model_path)
    original = load_model(model_path)
    opt = _opt(model_path, HUGE).model
    pos = _last_fused(opt)
    bad = _tamper_function(opt, pos) if how == "function" else _tamper_weight(opt, pos, base)
    check_structure(bad)
    budget = _tail_budget(opt, pos)
    segs = plan_segments(bad, budget)
    assert len(segs) > 3 and pos in segs[-1].node_positions and pos not in segs[-2].node_positions
    feeds = _feeds(original, base)

    good = compare_models(original, opt, feeds, base, budget_bytes=budget)
    assert good.ok, good.reason
    broken = compare_models(original, bad, feeds, base, budget_bytes=budget)
    assert not broken.ok
    assert broken.reason.startswith(original.graph.output[0].name + ":") and "exceeds" in broken.reason
    assert compare_models(original, bad, feeds, base, budget_bytes=HUGE).ok is False


def _corrupting_apply(target: tuple[str, tuple[str, ...]], hits: list):
    """engine.apply that, after the rewrite `target` passed its check, multiplies its first output by 1.01 in the
    model it builds (what onnxruntime runs), leaving the verified replacement's reference semantics behind."""
    real = engine.apply

    def apply(g, rewrites):
        for m, rep in rewrites:
            if (m.pattern, m.nodes) == target:
                hits.append(m)
                rep.initializers.append(numpy_helper.from_array(np.array(1.01, np.float32), "__tamper_scale"))
                _scale_output(rep.nodes, "__tamper_scale", m.outputs[0])
        return real(g, rewrites)

    return apply


def test_engine_and_cli_reject_a_rewrite_broken_after_its_check(llama, tmp_path, monkeypatch):
    clean = _opt(llama, HUGE)
    target = _target_record(clean)
    # + 4: the fp32 scale the corruption adds beside the last fused node
    budget = _tail_budget(clean.model, _last_fused(clean.model)) + 4
    hits: list = []
    monkeypatch.setattr(engine, "apply", _corrupting_apply((target.match.pattern, target.match.nodes), hits))

    r = _opt(llama, budget)
    assert len(hits) == 1
    # Every per-rewrite check passed (the corruption came after them) ...
    assert _records(r) == _records(clean) and not r.rolled_back
    # ... and the segmented whole-model check caught it, in the last segment.
    assert r.verify_segments > LAYERS
    segs = plan_segments(r.model, budget)
    tampered = next(i for i, n in enumerate(r.model.graph.node) if n.name.endswith("__tamper"))
    assert tampered in segs[-1].node_positions and _last_fused(r.model) in segs[-1].node_positions
    assert r.ok is False and r.model_check.ok is False
    assert "logits" in r.model_check.reason and "exceeds" in r.model_check.reason

    # The CLI (in process, same monkeypatch): exit 1, the drift named, nothing written, inputs untouched.
    data = llama.with_name(llama.name + ".data")
    before = {p: _sha256(p) for p in (llama, data)}
    listing = sorted(p.name for p in llama.parent.iterdir())
    out = tmp_path / "out.onnx"
    hits.clear()
    res = CliRunner().invoke(main, ["optimize", str(llama), "-o", str(out), "--verify-memory", str(budget),
                                    "--force-fuse", "-q"])
    assert res.exit_code == 1, res.output
    assert len(hits) == 1
    assert "drifts from the original" in res.stderr and "logits" in res.stderr and "nothing written" in res.stderr
    assert list(tmp_path.iterdir()) == []
    assert sorted(p.name for p in llama.parent.iterdir()) == listing
    assert {p: _sha256(p) for p in (llama, data)} == before


# ---- 3. per-rewrite checks shared across repeated layers ---------------------------------------------------------

def _by_pattern(records, pattern: str):
    return [r for r in records if r.match.pattern == pattern]


def test_repeated_layers_share_one_check(llama):
    r = _opt(llama, TINY)
    assert r.ok and not r.rolled_back
    names = {rec.match.nodes[0]: rec for rec in r.records}
    for rec in r.applied:
        assert rec.check is not None and rec.check.ok
        assert rec.check.comparisons or rec.check.shared_with
        if rec.check.shared_with:   # shared with an earlier rewrite that really ran its check
            first = names[rec.check.shared_with]
            assert r.records.index(first) < r.records.index(rec)
            assert first.check.comparisons and not first.check.shared_with
            assert rec.check.comparisons == first.check.comparisons
        else:
            assert all(math.isfinite(c.max_abs_err) for c in rec.check.comparisons)

    for pattern in ("attention", "gated_mlp"):
        recs = _by_pattern(r.applied, pattern)
        assert len(recs) == LAYERS
        assert recs[0].check.shared_with == "" and recs[0].check.comparisons
        assert [x.check.shared_with for x in recs[1:]] == [recs[0].match.nodes[0]] * (LAYERS - 1)
    # Norm gammas (64 values) are part of the signature by value, and every layer's differs: nothing shared.
    norms = _by_pattern(r.applied, "rmsnorm")
    assert len(norms) == 2 * LAYERS + 1
    assert all(x.check.shared_with == "" and x.check.comparisons for x in norms)
    assert sum(bool(x.check.shared_with) for x in r.applied) == 2 * (LAYERS - 1)


def test_a_failed_check_is_shared_as_a_failure(llama, monkeypatch):
    clean = _opt(llama, TINY)
    real = engine.check_rewrite
    calls: list[str] = []

    def failing_first_attention(g, m, rep, values):
        calls.append(m.pattern)
        if m.pattern == "attention" and calls.count("attention") == 1:
            return RewriteCheck(False, reason="forced failure")
        return real(g, m, rep, values)

    monkeypatch.setattr(engine, "check_rewrite", failing_first_attention)
    r = _opt(llama, TINY)

    assert calls.count("attention") == 1     # one real check for the 4 identical layers
    back = _by_pattern(r.rolled_back, "attention")
    assert len(back) == LAYERS and not _by_pattern(r.applied, "attention")
    assert back[0].check.shared_with == "" and back[0].reason == "forced failure"
    assert all(x.check.shared_with == back[0].match.nodes[0] and not x.check.ok and x.reason == "forced failure"
               for x in back[1:])
    assert r.rolled_back == back
    # Everything else is as in the clean run, and the model (attention left unfused) still verifies.
    others = Counter(k for k in clean.applied_by_kind().elements() if not k.startswith("FusedAttention"))
    assert r.applied_by_kind() == others
    assert r.ok and r.model_check.ok


# ---- 4. the activation store spills -------------------------------------------------------------------------------

class _SpyStore(ActivationStore):
    instances: list[_SpyStore] = []

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.spill_dirs: list[str] = []
        self.ram_puts = self.disk_puts = self.mapped_gets = 0
        _SpyStore.instances.append(self)

    def put(self, name, arr):
        super().put(name, arr)
        if name in self._ram:
            self.ram_puts += 1
        else:
            self.disk_puts += 1
            if self.dir not in self.spill_dirs:
                self.spill_dirs.append(self.dir)

    def get(self, name):
        arr = super().get(name)
        self.mapped_gets += isinstance(arr, np.memmap)
        return arr


def test_spilling_store_gives_the_same_checks(llama, monkeypatch):
    in_ram = _opt(llama, TINY)
    _SpyStore.instances.clear()
    monkeypatch.setattr(engine, "ActivationStore", lambda *a, **kw: _SpyStore(*a, **{**kw, "memory_bytes": 0}))
    spilled = _opt(llama, TINY)

    (store,) = _SpyStore.instances
    assert store.ram_puts == 0 and store.disk_puts > 100 and store.mapped_gets > 0
    assert len(store.spill_dirs) == 1 and not Path(store.spill_dirs[0]).exists()   # removed at the end
    assert spilled.notes == [] and spilled.ok
    assert _records(spilled) == _records(in_ram)
    ran = 0
    for a, b in zip(spilled.records, in_ram.records):
        if a.check is not None and not a.check.shared_with:
            errs = [c.max_abs_err for c in a.check.comparisons]
            assert errs and all(math.isfinite(e) and e < 1e-3 for e in errs)
            assert errs == [c.max_abs_err for c in b.check.comparisons]   # the same real activations
            ran += 1
    assert ran >= 2 * LAYERS + 3
    assert spilled.model_check.comparisons[0].max_abs_err == in_ram.model_check.comparisons[0].max_abs_err


# ---- 5. the input files are left as they were ---------------------------------------------------------------------

def test_cli_run_with_segmented_verification_leaves_inputs_untouched(llama, tmp_path, monkeypatch):
    runs = []
    real = engine.optimize
    monkeypatch.setattr(engine, "optimize", lambda *a, **kw: runs.append(real(*a, **kw)) or runs[-1])
    data = llama.with_name(llama.name + ".data")
    bert = FIXTURES / "bert_ts17.onnx"
    inputs = [llama, data, bert]
    before = {p: _sha256(p) for p in inputs}
    mtimes = {p: p.stat().st_mtime_ns for p in inputs}

    for src, out in ((llama, tmp_path / "llama.opt.onnx"), (bert, tmp_path / "bert.opt.onnx")):
        res = CliRunner().invoke(main, ["optimize", str(src), "-o", str(out), "--verify-memory", "4KiB", "-q"])
        assert res.exit_code == 0, res.output
        assert out.exists()
        assert runs[-1].applied and runs[-1].model_check.ok and runs[-1].verify_segments > 3
    assert (tmp_path / "llama.opt.onnx.data").exists()      # external in, external out

    assert {p: _sha256(p) for p in inputs} == before
    assert {p: p.stat().st_mtime_ns for p in inputs} == mtimes
