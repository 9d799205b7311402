"""Weights stay where they are: lazy loading, streaming writes, shared data files, the input never touched."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from builders import conv_chain, random_feeds
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from npufuse.ir import weights
from npufuse.cli import main
from npufuse.ir.modelio import load_model, model_dir, write_model
from npufuse.ir.runtime import run


def mlp(seed: int = 0, width: int = 32) -> onnx.ModelProto:
    """X -> MatMul -> +b -> Relu -> MatMul -> +b -> Y: fuses into FusedMatMul epilogues, no weight changes."""
    rng = np.random.default_rng(seed)
    w1 = rng.standard_normal((16, width)).astype(np.float32) * 0.3
    w2 = rng.standard_normal((width, 8)).astype(np.float32) * 0.3
    inits = [numpy_helper.from_array(w1, "W1"), numpy_helper.from_array(rng.standard_normal(width).astype(np.float32), "B1"),
             numpy_helper.from_array(w2, "W2"), numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "B2")]
    nodes = [helper.make_node("MatMul", ["X", "W1"], ["m1"], name="mm1"),
             helper.make_node("Add", ["m1", "B1"], ["a1"], name="add1"),
             helper.make_node("Relu", ["a1"], ["r1"], name="relu1"),
             helper.make_node("MatMul", ["r1", "W2"], ["m2"], name="mm2"),
             helper.make_node("Add", ["m2", "B2"], ["Y"], name="add2")]
    g = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [4, 16])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [4, 8])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def save_external(model: onnx.ModelProto, folder: Path, name: str = "m.onnx", data: str = "m.onnx.data") -> Path:
    folder.mkdir(exist_ok=True)
    model = onnx.ModelProto.FromString(model.SerializeToString())  # onnx.save would turn the caller's copy external
    onnx.save(model, folder / name, save_as_external_data=True, all_tensors_to_one_file=True, location=data,
              size_threshold=1024)
    return folder / name


def cli(*args: str | Path) -> tuple[int, str]:
    r = CliRunner().invoke(main, [str(a) for a in args])
    return r.exit_code, r.output


def test_skeleton_holds_references_not_weights(tmp_path: Path) -> None:
    model = conv_chain(cin=16, cout=32)
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    skeleton = load_model(path)
    full = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    refs = [t for t in skeleton.graph.initializer if weights.is_external(t)]
    assert {t.name for t in refs} == {t.name for t in model.graph.initializer if len(t.raw_data) >= 1024}
    assert refs and all(weights.external_ref(t).location == "m.onnx" for t in refs)
    assert len(skeleton.SerializeToString()) < path.stat().st_size - sum(len(t.raw_data) for t in model.graph.initializer
                                                                        if t.name in {r.name for r in refs}) + 1024
    for t in skeleton.graph.initializer:
        got = weights.read_array(t, model_dir(path))
        np.testing.assert_array_equal(got, full[t.name])
        assert got.dtype == full[t.name].dtype


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.int8, np.int64, np.bool_])
def test_reference_reads_every_plain_dtype(tmp_path: Path, dtype) -> None:
    arr = (np.arange(2048) % 7 - 3).astype(dtype).reshape(32, 64)
    g = helper.make_graph([helper.make_node("Identity", ["T"], ["Y"])], "g", [],
                          [helper.make_tensor_value_info("Y", helper.np_dtype_to_tensor_dtype(arr.dtype), [32, 64])],
                          [numpy_helper.from_array(arr, "T")])
    path = tmp_path / "t.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    t = load_model(path).graph.initializer[0]
    assert weights.is_external(t)
    got = weights.read_array(t, str(tmp_path))
    np.testing.assert_array_equal(got, arr)
    assert not got.flags.writeable  # a map of the file, never a copy a rewrite could scribble on


def test_embedded_model_round_trips_through_the_streaming_writer(tmp_path: Path) -> None:
    model = conv_chain(cin=16, cout=32)
    src = tmp_path / "m.onnx"
    onnx.save(model, src)
    out = tmp_path / "copy.onnx"
    write_model(load_model(src), out, model_dir(src))
    onnx.checker.check_model(str(out), full_check=True)
    back = onnx.load(str(out))
    assert not any(weights.is_external(t) for t in back.graph.initializer)
    want = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    assert {t.name: numpy_helper.to_array(t).tolist() for t in back.graph.initializer} == \
        {k: v.tolist() for k, v in want.items()}


def test_external_input_gives_external_output_that_shares_unchanged_weights(tmp_path: Path) -> None:
    model = mlp()
    src = save_external(model, tmp_path / "src")
    before = {p.name: sha(p) for p in src.parent.iterdir()}
    out = tmp_path / "out" / "o.onnx"
    out.parent.mkdir()
    code, text = cli("optimize", src, "-o", out, "-q")
    assert code == 0, text
    assert {p.name: sha(p) for p in src.parent.iterdir()} == before  # the input and its data never touched
    onnx.checker.check_model(str(out))  # by path: locations resolve beside the output
    written = onnx.load(str(out), load_external_data=False)
    assert any(n.domain == "npufuse" for n in written.graph.node)
    locations = {weights.external_ref(t).location for t in written.graph.initializer if weights.is_external(t)}
    assert locations == {"o.onnx.data"}
    data = out.with_name("o.onnx.data")
    # Nothing was folded: every weight in the output's data file is the input's, byte for byte.
    source = {t.name: t for t in onnx.load(str(src), load_external_data=False).graph.initializer}
    out_refs = [t for t in written.graph.initializer if weights.is_external(t)]
    assert {t.name for t in out_refs} == {t.name for t in source.values() if weights.is_external(t)}
    for t in out_refs:
        np.testing.assert_array_equal(weights.read_array(t, str(out.parent)),
                                      weights.read_array(source[t.name], str(src.parent)))
    assert data.stat().st_nlink == 1  # never a hard link (onnx.checker refuses those, and writes would leak)
    feeds = random_feeds(model)
    np.testing.assert_allclose(run(onnx.load(str(out)), feeds)["Y"], run(model, feeds)["Y"], rtol=1e-5, atol=1e-5)


def test_folded_weights_go_to_a_fresh_data_file(tmp_path: Path) -> None:
    model = conv_chain(cin=16, cout=32)
    src = save_external(model, tmp_path / "src")
    before = sha(src.with_name("m.onnx.data"))
    out = tmp_path / "o.onnx"
    code, text = cli("optimize", src, "-o", out, "-q")
    assert code == 0, text
    assert sha(src.with_name("m.onnx.data")) == before
    data = out.with_name("o.onnx.data")
    assert not os.path.samefile(data, src.with_name("m.onnx.data"))
    onnx.checker.check_model(str(out))
    feeds = random_feeds(model)
    want = run(model, feeds)["Y"]
    got = run(onnx.load(str(out)), feeds)["Y"]
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


def test_sparse_weights_stay_sparse_when_copied(tmp_path: Path) -> None:
    """A hole in the input's data (here: all of it) is neither read nor written: the copy has no blocks either."""
    src_dir = tmp_path / "src"
    src_dir.mkdir()
    n = 1 << 22  # 4 Mi float32 = 16 MiB of zeros, never written
    t = onnx.TensorProto(name="W", data_type=TensorProto.FLOAT, dims=[n // 64, 64])
    weights.set_external_ref(t, "w.bin", 0, n * 4)
    with open(src_dir / "w.bin", "wb") as f:
        f.truncate(n * 4)
    g = helper.make_graph([helper.make_node("Relu", ["W"], ["Y"])], "g", [],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [n // 64, 64])], [t])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), src_dir / "m.onnx")
    out = tmp_path / "o.onnx"
    skeleton = load_model(src_dir / "m.onnx")
    extra = numpy_helper.from_array(np.ones(1024, np.float32), "unused_new")  # forces a fresh data file
    skeleton.graph.initializer.append(extra)
    write_model(skeleton, out, str(src_dir), external=True)
    data = out.with_name("o.onnx.data")
    assert data.stat().st_size >= n * 4
    assert data.stat().st_blocks * 512 < 1 << 20
    back = onnx.load(str(out))
    assert float(np.abs(numpy_helper.to_array(back.graph.initializer[0])).max()) == 0.0


@pytest.mark.parametrize("target", ["m.onnx.data", "m.onnx"])
def test_output_that_names_an_input_data_file_is_refused(tmp_path: Path, target: str) -> None:
    src = save_external(mlp(), tmp_path / "src")
    before = {p.name: sha(p) for p in src.parent.iterdir()}
    # -o m.onnx.data names the data file; -o m.onnx (with --overwrite) would write m.onnx.data over it.
    code, text = cli("optimize", src, "-o", src.with_name(target), "--overwrite", "-q")
    assert code == 2
    assert "data file" in text and len(text.strip().splitlines()) == 1
    assert {p.name: sha(p) for p in src.parent.iterdir()} == before


def test_an_unchanged_initializer_is_never_loaded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading a weight goes through weights.read_array (or onnx's loaders): none of them may see W1 or W2, which
    no rewrite changes, in an optimize run without verification."""
    src = save_external(mlp(), tmp_path / "src")
    seen: list[str] = []
    real = weights.read_array

    def spy(t, base_dir):
        seen.append(t.name)
        return real(t, base_dir)

    def refuse(*a, **k):
        raise AssertionError("onnx's external-data loader must not run")

    monkeypatch.setattr(weights, "read_array", spy)
    monkeypatch.setattr("npufuse.ir.graph.read_array", spy)
    monkeypatch.setattr(onnx.external_data_helper, "load_external_data_for_tensor", refuse)
    monkeypatch.setattr(onnx.external_data_helper, "load_external_data_for_model", refuse)
    code, text = cli("optimize", src, "-o", tmp_path / "o.onnx", "--no-verify", "-q")
    assert code == 0, text
    assert "W1" not in seen and "W2" not in seen


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their permissions")
def test_an_unreadable_unchanged_weight_file_does_not_stop_a_run(tmp_path: Path) -> None:
    src = save_external(mlp(), tmp_path / "src")
    data = src.with_name("m.onnx.data")
    data.chmod(0)
    try:
        code, text = cli("optimize", src, "-o", tmp_path / "o.onnx", "--no-verify", "-q")
    finally:
        data.chmod(0o644)
    assert code == 0, text
