"""Segmented execution: a model run in bounded memory, segment by segment, equals the whole-model run."""

from __future__ import annotations

import builtins
import os
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from npufuse.verify.segments import (DEFAULT_VERIFY_MEMORY_BYTES, ActivationStore, Segment, plan_segments,
                                     run_segmented)

DIM = 16
BATCH = 2
LAYER_BYTES = DIM * DIM * 4 + DIM * 4  # one MatMul weight and one bias, fp32


def _layers(rng: np.random.Generator, n: int, start: str = "X", bad_layer: int | None = None):
    """n x (MatMul -> Add -> Relu); layer i's nodes are mm{i}, add{i}, relu{i} and its output h{i}."""
    nodes, inits = [], []
    cur = start
    for i in range(n):
        rows = DIM + 1 if i == bad_layer else DIM
        inits.append(numpy_helper.from_array((rng.standard_normal((rows, DIM)) * 0.5).astype(np.float32), f"W{i}"))
        inits.append(numpy_helper.from_array(rng.standard_normal(DIM).astype(np.float32), f"B{i}"))
        nodes += [helper.make_node("MatMul", [cur, f"W{i}"], [f"m{i}"], name=f"mm{i}"),
                  helper.make_node("Add", [f"m{i}", f"B{i}"], [f"a{i}"], name=f"add{i}"),
                  helper.make_node("Relu", [f"a{i}"], [f"h{i}"], name=f"relu{i}")]
        cur = f"h{i}"
    return nodes, inits, cur


def _save_external(model: onnx.ModelProto, folder: Path, name: str = "model.onnx") -> tuple[onnx.ModelProto, str]:
    """Save with every tensor in w.data and load back the skeleton only (references, no weight bytes)."""
    path = folder / name
    onnx.save(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location="w.data",
              size_threshold=0)
    skeleton = onnx.load(str(path), load_external_data=False)
    assert any(t.data_location == TensorProto.EXTERNAL for t in skeleton.graph.initializer)
    return skeleton, str(folder)


def _model(graph: onnx.GraphProto, functions=(), extra_opsets=()) -> onnx.ModelProto:
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), *extra_opsets],
                          functions=list(functions))
    m.ir_version = 10
    return m


def chain(tmp_path: Path, layers: int = 6, skip: bool = False, early_output: bool = False,
          bad_layer: int | None = None) -> tuple[onnx.ModelProto, str]:
    rng = np.random.default_rng(0)
    nodes, inits, cur = _layers(rng, layers, bad_layer=bad_layer)
    outputs = []
    if skip:  # h0 is read again by the very last node
        nodes.append(helper.make_node("Add", [cur, "h0"], ["Y"], name="skip"))
    else:
        nodes.append(helper.make_node("Identity", [cur], ["Y"], name="out"))
    outputs.append(helper.make_tensor_value_info("Y", TensorProto.FLOAT, None))
    if early_output:
        outputs.append(helper.make_tensor_value_info("h0", TensorProto.FLOAT, None))
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["n", DIM])],
                              outputs, inits)
    return _save_external(_model(graph), tmp_path)


def feeds() -> dict[str, np.ndarray]:
    return {"X": np.random.default_rng(1).standard_normal((BATCH, DIM)).astype(np.float32)}


def reference(base_dir: str, inputs: dict[str, np.ndarray], extra_outputs=(), name: str = "model.onnx",
              model: onnx.ModelProto | None = None) -> dict[str, np.ndarray]:
    """Plain onnxruntime on the whole model, by path (so ORT resolves w.data itself)."""
    path = Path(base_dir) / name
    if extra_outputs:
        model = model or onnx.load(str(path), load_external_data=False)
        model = onnx.ModelProto.FromString(model.SerializeToString())
        model.graph.output.extend(onnx.ValueInfoProto(name=v) for v in extra_outputs)
        path = Path(base_dir) / "reference.onnx"
        path.write_bytes(model.SerializeToString())
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, inputs)))


def assert_same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, err_msg=k)


# ---- 1, 2: tiny and large budgets ------------------------------------------------------------------------------

def test_tiny_budget_one_segment_per_layer(tmp_path):
    model, base = chain(tmp_path)
    plan = plan_segments(model, LAYER_BYTES)
    assert len(plan) == 6
    assert [s.node_positions for s in plan[:2]] == [range(0, 3), range(3, 6)]
    assert all(s.weight_bytes == LAYER_BYTES for s in plan)
    assert plan[1].inputs == ("h0",) and plan[0].outputs == ("h0",)
    assert plan[0].inputs == ("X",) and plan[-1].outputs == ("Y",)
    calls = []
    got = run_segmented(model, feeds(), base, budget_bytes=LAYER_BYTES, progress=lambda d, t: calls.append((d, t)))
    assert_same(got, reference(base, feeds()))
    assert calls == [(i, 6) for i in range(1, 7)]


def test_one_byte_budget_still_runs(tmp_path):
    model, base = chain(tmp_path)
    plan = plan_segments(model, 1)
    # Every node bringing a weight starts a segment; the weightless Relu joins the Add before it.
    assert len(plan) == 12 and plan[1].node_positions == range(1, 3)
    assert_same(run_segmented(model, feeds(), base, budget_bytes=1), reference(base, feeds()))


def test_large_budget_one_segment(tmp_path):
    model, base = chain(tmp_path)
    plan = plan_segments(model, DEFAULT_VERIFY_MEMORY_BYTES)
    assert plan == [Segment(0, range(0, 19), 6 * LAYER_BYTES, ("X",), ("Y",))]
    assert_same(run_segmented(model, feeds(), base), reference(base, feeds()))


# ---- 3: capture and spilling -----------------------------------------------------------------------------------

def test_capture_all_matches_whole_model_and_spills(tmp_path):
    model, base = chain(tmp_path)
    intermediates = [o for n in model.graph.node for o in n.output if o != "Y"]
    want = reference(base, feeds(), extra_outputs=intermediates, model=model)
    with ActivationStore(memory_bytes=0, dir=str(tmp_path)) as store:
        got = run_segmented(model, feeds(), base, budget_bytes=LAYER_BYTES, capture="all", store=store)
        assert_same(got, {"Y": want["Y"]})
        assert store.names() == set(intermediates) | {"Y"}
        assert store.ram_bytes == 0
        spill_dir = store.dir
        assert spill_dir is not None and Path(spill_dir).parent == tmp_path
        assert len(os.listdir(spill_dir)) == len(intermediates) + 1
        for name in intermediates:
            arr = store.get(name)
            assert isinstance(arr, np.memmap)
            np.testing.assert_allclose(arr, want[name], rtol=1e-6, err_msg=name)
        assert store.get("nope") is None and "nope" not in store and "h3" in store
    assert not os.path.exists(spill_dir)
    assert store.names() == set()


def test_capture_named_values_and_ram_store(tmp_path):
    model, base = chain(tmp_path)
    want = reference(base, feeds(), extra_outputs=["a2", "h4"], model=model)
    plan = plan_segments(model, LAYER_BYTES, capture=["a2"])
    assert plan[2].outputs == ("a2", "h2")
    with ActivationStore() as store:
        run_segmented(model, feeds(), base, budget_bytes=LAYER_BYTES, capture=["a2", "h4", "X"], store=store)
        assert store.names() == {"a2", "h4", "X"} and store.dir is None  # all fits in RAM: nothing spilled
        np.testing.assert_allclose(store.get("a2"), want["a2"], rtol=1e-6)
        np.testing.assert_allclose(store.get("h4"), want["h4"], rtol=1e-6)
        np.testing.assert_array_equal(store.get("X"), feeds()["X"])
    with pytest.raises(ValueError, match="store"):
        run_segmented(model, feeds(), base, capture=["a2"])


def test_store_ram_limit_replace_and_strings(tmp_path):
    with ActivationStore(memory_bytes=100, dir=str(tmp_path)) as store:
        store.put("a", np.arange(20, dtype=np.float32))  # 80 bytes: RAM
        store.put("b", np.arange(20, dtype=np.float32))  # would exceed: disk
        assert store.ram_bytes == 80 and store.dir is not None
        assert not isinstance(store.get("a"), np.memmap) and isinstance(store.get("b"), np.memmap)
        store.put("a", np.ones(3, np.int64))  # replacing frees its RAM
        assert store.ram_bytes == 24
        store.put("s", np.array(["x" * 200, "y"] * 5, dtype=object))  # object arrays spill pickled
        assert list(store.get("s")) == ["x" * 200, "y"] * 5
        store.put("b", np.zeros(1, np.float32))  # replacing a spilled array removes its file
        assert len(os.listdir(store.dir)) == 1
        d = store.dir
    assert not os.path.exists(d)


# ---- 4: functions and subgraphs --------------------------------------------------------------------------------

def test_model_local_function(tmp_path):
    body = [helper.make_node("MatMul", ["x", "w"], ["t"]), helper.make_node("Relu", ["t"], ["y"])]
    fn = helper.make_function("npufuse", "DenseRelu", ["x", "w"], ["y"], body,
                              opset_imports=[helper.make_opsetid("", 17)])
    rng = np.random.default_rng(2)
    inits = [numpy_helper.from_array(rng.standard_normal((DIM, DIM)).astype(np.float32), f"W{i}") for i in range(3)]
    nodes = [helper.make_node("DenseRelu", ["X" if i == 0 else f"h{i - 1}", f"W{i}"], [f"h{i}"], name=f"f{i}",
                              domain="npufuse") for i in range(3)]
    graph = helper.make_graph(nodes, "fn", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [BATCH, DIM])],
                              [helper.make_tensor_value_info("h2", TensorProto.FLOAT, None)], inits)
    model, base = _save_external(_model(graph, [fn], [helper.make_opsetid("npufuse", 1)]), tmp_path)
    assert len(plan_segments(model, DIM * DIM * 4)) == 3
    got = run_segmented(model, feeds(), base, budget_bytes=DIM * DIM * 4)
    assert_same(got, reference(base, feeds()))


def test_if_reading_outer_scope_values(tmp_path):
    rng = np.random.default_rng(3)
    nodes, inits, cur = _layers(rng, 2)
    # The branches read h1 (made by an earlier segment) and E0/E1 (external initializers of the main graph).
    inits += [numpy_helper.from_array(rng.standard_normal(DIM).astype(np.float32), f"E{i}") for i in range(2)]
    then_g = helper.make_graph([helper.make_node("Add", [cur, "E0"], ["t_out"])], "then", [],
                               [helper.make_tensor_value_info("t_out", TensorProto.FLOAT, None)])
    else_g = helper.make_graph([helper.make_node("Sub", [cur, "E1"], ["e_out"])], "else", [],
                               [helper.make_tensor_value_info("e_out", TensorProto.FLOAT, None)])
    nodes += [helper.make_node("ReduceSum", ["X"], ["s"], name="sum", keepdims=0),
              helper.make_node("Greater", ["s", "zero"], ["cond"], name="gt"),
              helper.make_node("If", ["cond"], ["Y"], name="if", then_branch=then_g, else_branch=else_g)]
    inits.append(numpy_helper.from_array(np.zeros((), np.float32), "zero"))
    graph = helper.make_graph(nodes, "if", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [BATCH, DIM])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)], inits)
    model, base = _save_external(_model(graph), tmp_path)
    plan = plan_segments(model, LAYER_BYTES)
    last = plan[-1]
    assert model.graph.node[last.node_positions[-1]].op_type == "If"
    assert "h1" in last.inputs and last.weight_bytes == 2 * DIM * 4 + 4  # E0, E1 (read by the If) and zero
    for x in (feeds()["X"], -np.abs(feeds()["X"]), np.abs(feeds()["X"])):
        got = run_segmented(model, {"X": x}, base, budget_bytes=LAYER_BYTES)
        assert_same(got, reference(base, {"X": x}))


# ---- 5: values crossing many segments ----------------------------------------------------------------------------

def test_skip_connection_and_early_graph_output(tmp_path):
    model, base = chain(tmp_path, skip=True, early_output=True)
    plan = plan_segments(model, LAYER_BYTES)
    assert len(plan) == 6
    assert plan[0].outputs == ("h0",)  # read by segment 1 and the last, and a graph output
    assert set(plan[-1].inputs) == {"h4", "h0"}
    assert all("h0" not in s.inputs for s in plan[2:-1])
    got = run_segmented(model, feeds(), base, budget_bytes=LAYER_BYTES)
    assert list(got) == ["Y", "h0"]
    assert_same(got, reference(base, feeds()))


def test_outputs_without_producer_and_overridable_initializer(tmp_path):
    rng = np.random.default_rng(4)
    nodes, inits, cur = _layers(rng, 2)
    inits.append(numpy_helper.from_array(rng.standard_normal(DIM).astype(np.float32), "S"))  # also a graph input
    nodes.append(helper.make_node("Mul", [cur, "S"], ["Y"], name="scale"))
    graph = helper.make_graph(
        nodes, "io",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [BATCH, DIM]),
         helper.make_tensor_value_info("S", TensorProto.FLOAT, [DIM])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("Y", "X", "W1", "S")], inits)
    model, base = _save_external(_model(graph), tmp_path)
    want = reference(base, feeds())
    got = run_segmented(model, feeds(), base, budget_bytes=LAYER_BYTES)
    assert list(got) == ["Y", "X", "W1", "S"]
    assert_same(got, want)
    s = np.full(DIM, 3.0, np.float32)
    got = run_segmented(model, {**feeds(), "S": s}, base, budget_bytes=LAYER_BYTES)
    assert_same(got, reference(base, {**feeds(), "S": s}))
    np.testing.assert_array_equal(got["S"], s)


def test_dead_nodes_and_undefined_input(tmp_path):
    model, base = chain(tmp_path, layers=2)
    model.graph.node.append(helper.make_node("Add", ["h0", "W0"], ["unused"], name="dead"))
    plan = plan_segments(model, LAYER_BYTES)
    assert len(plan) == 3 and plan[-1].outputs == ()  # nothing needs it: not run
    calls = []
    got = run_segmented(model, feeds(), base, budget_bytes=LAYER_BYTES, progress=lambda d, t: calls.append(d))
    assert_same(got, reference(base, feeds()))
    assert calls == [1, 2, 3]
    with pytest.raises(RuntimeError, match=r"segment 1/3 \(nodes mm0\.\.relu0\): no value for 'X'"):
        run_segmented(model, {}, base, budget_bytes=LAYER_BYTES)
    with pytest.raises(ValueError, match="base_dir"):
        run_segmented(model, feeds(), None)


# ---- 6: no weight bytes in Python ------------------------------------------------------------------------------

def test_external_data_never_read_by_python(tmp_path, monkeypatch):
    model, base = chain(tmp_path, skip=True, early_output=True)
    want = reference(base, feeds(), extra_outputs=["a3"], model=model)

    def forbidden(*args, **kwargs):
        raise AssertionError("weights read by Python")

    real_open = builtins.open

    def guarded_open(file, *args, **kwargs):
        if str(file).endswith("w.data"):
            raise AssertionError("w.data opened by Python")
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(onnx.numpy_helper, "to_array", forbidden)
    monkeypatch.setattr(onnx.external_data_helper, "load_external_data_for_tensor", forbidden)
    monkeypatch.setattr(onnx.external_data_helper, "load_external_data_for_model", forbidden)
    monkeypatch.setattr(onnx, "load_external_data_for_model", forbidden)
    monkeypatch.setattr(builtins, "open", guarded_open)
    with ActivationStore(memory_bytes=0) as store:
        got = run_segmented(model, feeds(), base, budget_bytes=LAYER_BYTES, capture=["a3"], store=store)
        np.testing.assert_allclose(store.get("a3"), want["a3"], rtol=1e-6)
    assert_same(got, {k: want[k] for k in ("Y", "h0")})


# ---- 7: errors ---------------------------------------------------------------------------------------------------

def test_ort_failure_names_the_segment(tmp_path):
    model, base = chain(tmp_path, bad_layer=2)  # W2 has DIM+1 rows: MatMul shapes disagree
    with pytest.raises(RuntimeError, match=r"^segment 3/6 \(nodes mm2\.\.relu2\): .*\S") as info:
        run_segmented(model, feeds(), base, budget_bytes=LAYER_BYTES + DIM * 4)
    assert "\n" not in str(info.value)


def test_unnamed_nodes_are_labelled_by_position(tmp_path):
    model, base = chain(tmp_path, bad_layer=0)
    for n in model.graph.node:
        n.name = ""
    with pytest.raises(RuntimeError, match=r"^segment 1/6 \(nodes <MatMul #0>\.\.<Relu #2>\): "):
        run_segmented(model, feeds(), base, budget_bytes=LAYER_BYTES + DIM * 4)


# ---- planning scales -------------------------------------------------------------------------------------------

def test_planning_is_linear():
    n = 30_000
    nodes = [helper.make_node("Add", ["X" if i == 0 else f"v{i - 1}", f"c{i}"], [f"v{i}"]) for i in range(n)]
    inits = [helper.make_tensor(f"c{i}", TensorProto.FLOAT, [1], [1.0]) for i in range(n)]
    graph = helper.make_graph(nodes, "long", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info(f"v{n - 1}", TensorProto.FLOAT, None)], inits)
    model = _model(graph)
    t0 = time.perf_counter()
    plan = plan_segments(model, 1)  # one segment per node: a quadratic planner would take minutes
    elapsed = time.perf_counter() - t0
    assert len(plan) == n and plan[-1].inputs == (f"v{n - 2}",) and plan[5].outputs == ("v5",)
    assert elapsed < 10, elapsed
