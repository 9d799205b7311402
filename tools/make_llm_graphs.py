#!/usr/bin/env python3
"""Write big Llama-shaped ONNX graphs without writing big weights.

The graphs are the decoder-only Llama structure as HF's TorchScript export lays it out (without rotary
embeddings and without the mask computation): ``input_ids`` int64 [batch, seq] and an additive float
``attention_mask`` [batch, 1, seq, seq] (the model's dtype) in, ``logits`` [batch, seq, vocab] out, and per
layer

* RMSNorm decomposed as HF exports it, ``weight * (x * (1 / Sqrt(ReduceMean(Pow(x, 2)) + eps)))``
  (fp16 models Cast to fp32 around the statistics, as HF does);
* attention: Q/K/V MatMuls (K/V [hidden, kv_heads*head_dim] for grouped-query attention, with HF's
  ``repeat_kv``: Unsqueeze -> Expand -> Reshape), head split Reshape [0,0,H,D] + Transpose(0,2,1,3),
  Kᵀ Transpose(0,1,3,2), Q·Kᵀ MatMul, Div by sqrt(head_dim), Add mask, Softmax(axis=-1) (fp16: in fp32
  between Casts, as HF's eager attention), ·V MatMul, head merge Transpose + Reshape [0,0,H*D], O MatMul,
  residual Add;
* RMSNorm, SwiGLU MLP: gate MatMul -> x*Sigmoid(x), up MatMul, Mul, down MatMul, residual Add;

then a final RMSNorm and the lm_head MatMul [hidden, vocab]. Opset 17 (ai.onnx), IR version 8, shapes as
int64 initializers (0 / -1 and explicit head counts, so a symbolic batch and seq work).

Weights:

* ``sparse`` (the default of the big presets): every initializer over 1 KiB is external, in ONE file
  ``<model file name>.data`` beside the model (``llama7b.onnx`` -> ``llama7b.onnx.data``), at offsets
  computed here (each tensor aligned to 4096 bytes); the file gets its size from ``os.truncate`` and no
  byte is written, so it is sparse: the 7B preset's ~12.6 GiB data file takes ~0 bytes of disk and reads as
  zeros. The .onnx is written by ``onnx.save_model`` from a proto whose tensors already carry
  ``data_location=EXTERNAL`` and location/offset/length: no big array is ever built. Small tensors (shapes,
  scalars, norm gammas of tiny models) are embedded; the embedded gammas are ones, other small weights
  zeros. For memory and time benchmarks only: every activation is zero.
* ``random``: seeded N(0, 0.02) weights (norm gammas 1 + N(0, 0.1)), embedded, or with ``--external`` in
  the same aligned single-file layout (bytes really written); small models only, for meaningful numerics.

Presets (``--preset``, repeatable, or ``all``); any dimension can be overridden on the command line:

=======  ======  ======  =====  ========  ============  =====  =======  =======
preset   layers  hidden  heads  kv_heads  intermediate  vocab  dtype    weights
=======  ======  ======  =====  ========  ============  =====  =======  =======
7b       32      4096    32     32        11008         32000  float16  sparse
1b       22      2048    32     4 (GQA)   5632          32000  float32  sparse
100k     2560    32      4      4         64            128    float32  sparse
tiny     2       64      4      4         128           100    float32  random
=======  ======  ======  =====  ========  ============  =====  =======  =======

(100k: 40 nodes a layer, 102,409 nodes in all; 7b: ~6.7 G parameters, 1b: ~1.1 G (TinyLlama-1.1B's shape).)

Usage (files go under the folder given with -o, never into the repository by default)::

    python tools/make_llm_graphs.py --preset 7b --preset 1b -o benchmarks/.cache
    python tools/make_llm_graphs.py --preset tiny -o /tmp/llm --smoke     # + run it in onnxruntime
    python tools/make_llm_graphs.py --layers 4 --hidden 256 --heads 8 --kv-heads 2 --intermediate 512 \\
        --vocab 1000 --weights random --external --name small -o /tmp/llm

Each written model is checked with ``onnx.checker.check_model(path)`` (``--no-check`` skips it) and its
node count, weight bytes and the data file's apparent and on-disk sizes are printed.
Importable: ``make_llama_graph(out_path, layers=..., hidden=..., heads=..., intermediate=..., vocab=...)``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
IR_VERSION = 8
EXTERNAL_THRESHOLD = 1024     # bytes: initializers bigger than this go to the data file
ALIGN = 4096                  # bytes: alignment of each tensor in the data file

PRESETS: dict[str, dict] = {
    "7b": dict(layers=32, hidden=4096, heads=32, kv_heads=None, intermediate=11008, vocab=32000,
               dtype="float16", weights="sparse"),
    "1b": dict(layers=22, hidden=2048, heads=32, kv_heads=4, intermediate=5632, vocab=32000,
               dtype="float32", weights="sparse"),
    "100k": dict(layers=2560, hidden=32, heads=4, kv_heads=None, intermediate=64, vocab=128,
                 dtype="float32", weights="sparse"),
    "tiny": dict(layers=2, hidden=64, heads=4, kv_heads=None, intermediate=128, vocab=100,
                 dtype="float32", weights="random"),
}
PRESET_FILES = {"7b": "llama7b.onnx", "1b": "llama1b.onnx", "100k": "llama100k.onnx", "tiny": "llama_tiny.onnx"}

_DTYPES = {"float16": (TensorProto.FLOAT16, np.float16), "float32": (TensorProto.FLOAT, np.float32)}


class _Weights:
    """Initializers: embedded, or external in one aligned data file (sparse or really written)."""

    def __init__(self, mode: str, np_dtype, data_path: Path | None, rng: np.random.Generator | None):
        self.mode = mode
        self.np_dtype = np.dtype(np_dtype)
        self.onnx_dtype = helper.np_dtype_to_tensor_dtype(self.np_dtype)
        self.data_path = data_path          # None: everything embedded
        self.rng = rng
        self.size = 0                       # data file size so far
        self.pending: list[tuple[int, np.ndarray]] = []   # random + external: (offset, array) to write
        self.tensors: list[TensorProto] = []
        self.weight_bytes = 0               # all weights, embedded or external

    def _values(self, shape: tuple[int, ...], kind: str) -> np.ndarray:
        if self.mode == "random":
            if kind == "gamma":
                a = 1.0 + 0.1 * self.rng.standard_normal(shape)
            else:
                a = 0.02 * self.rng.standard_normal(shape)
        else:
            a = np.ones(shape) if kind == "gamma" else np.zeros(shape)
        return a.astype(self.np_dtype)

    def add(self, name: str, shape: tuple[int, ...], kind: str = "weight") -> str:
        nbytes = math.prod(shape) * self.np_dtype.itemsize
        self.weight_bytes += nbytes
        if self.data_path is None or nbytes <= EXTERNAL_THRESHOLD:
            self.tensors.append(numpy_helper.from_array(self._values(shape, kind), name))
            return name
        offset = -(-self.size // ALIGN) * ALIGN
        self.size = offset + nbytes
        t = TensorProto()
        t.name = name
        t.data_type = self.onnx_dtype
        t.dims.extend(shape)
        t.data_location = TensorProto.EXTERNAL
        for k, v in (("location", self.data_path.name), ("offset", str(offset)), ("length", str(nbytes))):
            e = t.external_data.add()
            e.key, e.value = k, v
        if self.mode == "random":
            self.pending.append((offset, self._values(shape, kind)))
        self.tensors.append(t)
        return name

    def write_data_file(self) -> None:
        if self.data_path is None:
            return
        if self.data_path.exists():
            self.data_path.unlink()     # truncating a file that has blocks would keep them
        with open(self.data_path, "wb") as f:
            for offset, a in self.pending:
                f.seek(offset)
                f.write(a.tobytes())
        os.truncate(self.data_path, self.size)   # sparse: the rest is holes


def make_llama_graph(out_path, *, layers: int, hidden: int, heads: int, kv_heads: int | None = None,
                     intermediate: int, vocab: int, dtype: str = "float16", seq: int | None = None,
                     batch: int | None = None, weights: str = "sparse", seed: int = 0, external: bool = False,
                     eps: float = 1e-6) -> Path:
    """Write a Llama-shaped decoder-only ONNX model to ``out_path`` (see the module docstring).

    ``weights='sparse'``: initializers over 1 KiB external in a sparse ``<file name>.data`` (zeros, nothing
    written); ``weights='random'``: seeded random weights, embedded unless ``external``. ``seq``/``batch``
    None: symbolic dims 'seq'/'batch'. Returns the model's path.
    """
    out_path = Path(out_path)
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, not {dtype!r}")
    if weights not in ("sparse", "random"):
        raise ValueError(f"weights must be 'sparse' or 'random', not {weights!r}")
    kv_heads = kv_heads or heads
    if hidden % heads or heads % kv_heads:
        raise ValueError(f"hidden ({hidden}) must divide by heads ({heads}), heads by kv_heads ({kv_heads})")
    head_dim = hidden // heads
    kv_dim = kv_heads * head_dim
    n_rep = heads // kv_heads
    et, npt = _DTYPES[dtype]
    fp16 = dtype == "float16"
    compute_t, compute_np = (TensorProto.FLOAT, np.float32)   # norm statistics and softmax

    out_path.parent.mkdir(parents=True, exist_ok=True)
    data_path = out_path.with_name(out_path.name + ".data") if (weights == "sparse" or external) else None
    w = _Weights(weights, npt, data_path, np.random.default_rng(seed) if weights == "random" else None)

    nodes: list[onnx.NodeProto] = []
    consts: list[TensorProto] = []

    def const(name: str, value, np_dtype) -> str:
        consts.append(numpy_helper.from_array(np.asarray(value, dtype=np_dtype), name))
        return name

    counter = [0]

    def op(op_type: str, inputs: list[str], prefix: str, **attrs) -> str:
        counter[0] += 1
        out = f"{prefix}/{op_type}_{counter[0]}"
        nodes.append(helper.make_node(op_type, inputs, [out], name=out, **attrs))
        return out

    norm_np = compute_np if fp16 else npt
    c_two = const("const.two", 2.0, norm_np)
    c_eps = const("const.eps", eps, norm_np)
    c_one = const("const.one", 1.0, norm_np)
    c_scale = const("const.sqrt_head_dim", math.sqrt(head_dim), npt)
    s_q = const("shape.q_split", [0, 0, heads, head_dim], np.int64)
    s_kv = const("shape.kv_split", [0, 0, kv_heads, head_dim], np.int64)
    s_merge = const("shape.merge", [0, 0, hidden], np.int64)
    if n_rep > 1:
        ax2 = const("axes.2", [2], np.int64)
        s_expand = const("shape.kv_expand", [1, 1, n_rep, 1, 1], np.int64)
        s_rep = const("shape.kv_repeat", [0, heads, -1, head_dim], np.int64)

    def rmsnorm(x: str, gamma: str, p: str) -> str:
        xc = op("Cast", [x], p, to=compute_t) if fp16 else x
        r = op("Pow", [xc, c_two], p)
        r = op("ReduceMean", [r], p, axes=[-1], keepdims=1)
        r = op("Add", [r, c_eps], p)
        r = op("Sqrt", [r], p)
        r = op("Div", [c_one, r], p)
        y = op("Mul", [xc, r], p)
        if fp16:
            y = op("Cast", [y], p, to=et)
        return op("Mul", [gamma, y], p)

    def heads_of(t: str, shape: str, p: str) -> str:
        return op("Transpose", [op("Reshape", [t, shape], p)], p, perm=[0, 2, 1, 3])

    def repeat_kv(t: str, p: str) -> str:
        if n_rep == 1:
            return t
        t = op("Unsqueeze", [t, ax2], p)
        t = op("Expand", [t, s_expand], p)
        return op("Reshape", [t, s_rep], p)

    x = op("Gather", [w.add("model.embed_tokens.weight", (vocab, hidden)), "input_ids"], "/model/embed_tokens")
    for i in range(layers):
        L = f"model.layers.{i}"
        P = f"/model/layers.{i}"
        h = rmsnorm(x, w.add(f"{L}.input_layernorm.weight", (hidden,), "gamma"), f"{P}/input_layernorm")
        pa = f"{P}/self_attn"
        q = op("MatMul", [h, w.add(f"{L}.self_attn.q_proj.weight", (hidden, hidden))], pa)
        k = op("MatMul", [h, w.add(f"{L}.self_attn.k_proj.weight", (hidden, kv_dim))], pa)
        v = op("MatMul", [h, w.add(f"{L}.self_attn.v_proj.weight", (hidden, kv_dim))], pa)
        q = heads_of(q, s_q, pa)
        k = repeat_kv(heads_of(k, s_kv, pa), pa)
        v = repeat_kv(heads_of(v, s_kv, pa), pa)
        s = op("MatMul", [q, op("Transpose", [k], pa, perm=[0, 1, 3, 2])], pa)
        s = op("Div", [s, c_scale], pa)
        s = op("Add", [s, "attention_mask"], pa)
        if fp16:
            s = op("Cast", [op("Softmax", [op("Cast", [s], pa, to=compute_t)], pa, axis=-1)], pa, to=et)
        else:
            s = op("Softmax", [s], pa, axis=-1)
        a = op("MatMul", [s, v], pa)
        a = op("Reshape", [op("Transpose", [a], pa, perm=[0, 2, 1, 3]), s_merge], pa)
        a = op("MatMul", [a, w.add(f"{L}.self_attn.o_proj.weight", (hidden, hidden))], pa)
        x = op("Add", [x, a], P)
        h = rmsnorm(x, w.add(f"{L}.post_attention_layernorm.weight", (hidden,), "gamma"),
                    f"{P}/post_attention_layernorm")
        pm = f"{P}/mlp"
        g = op("MatMul", [h, w.add(f"{L}.mlp.gate_proj.weight", (hidden, intermediate))], pm)
        g = op("Mul", [g, op("Sigmoid", [g], pm)], pm)
        u = op("MatMul", [h, w.add(f"{L}.mlp.up_proj.weight", (hidden, intermediate))], pm)
        d = op("MatMul", [op("Mul", [g, u], pm), w.add(f"{L}.mlp.down_proj.weight", (intermediate, hidden))], pm)
        x = op("Add", [x, d], P)
    h = rmsnorm(x, w.add("model.norm.weight", (hidden,), "gamma"), "/model/norm")
    nodes.append(helper.make_node("MatMul", [h, w.add("lm_head.weight", (hidden, vocab))], ["logits"],
                                  name="/lm_head/MatMul"))

    B = batch if batch is not None else "batch"
    S = seq if seq is not None else "seq"
    graph = helper.make_graph(
        nodes, "llama",
        inputs=[helper.make_tensor_value_info("input_ids", TensorProto.INT64, [B, S]),
                helper.make_tensor_value_info("attention_mask", et, [B, 1, S, S])],
        outputs=[helper.make_tensor_value_info("logits", et, [B, S, vocab])],
        initializer=w.tensors + consts)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="npufuse-tools-make_llm_graphs", ir_version=IR_VERSION)
    meta = dict(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, intermediate=intermediate,
                vocab=vocab, dtype=dtype, weights=weights, seed=seed, weight_bytes=w.weight_bytes)
    helper.set_model_props(model, {k: str(v) for k, v in meta.items()})
    w.write_data_file()
    onnx.save_model(model, str(out_path))
    return out_path


def describe(path) -> dict:
    """Node count, weight bytes and file sizes of a model written by make_llama_graph (reads only the .onnx)."""
    path = Path(path)
    m = onnx.load(str(path), load_external_data=False)
    weight_bytes = 0
    for t in m.graph.initializer:
        weight_bytes += math.prod(t.dims) * helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
    info = {"path": str(path), "nodes": len(m.graph.node), "initializers": len(m.graph.initializer),
            "weight_bytes": weight_bytes, "onnx_bytes": path.stat().st_size}
    data = path.with_name(path.name + ".data")
    if data.exists():
        st = data.stat()
        info["data_apparent_bytes"] = st.st_size
        info["data_disk_bytes"] = st.st_blocks * 512
    return info


def smoke_run(path, batch: int = 2, seq: int = 8, seed: int = 0) -> np.ndarray:
    """Run the model in onnxruntime on random token ids and a causal mask; return the logits."""
    import onnxruntime as ort

    m = onnx.load(str(path), load_external_data=False)
    props = {p.key: p.value for p in m.metadata_props}
    vocab = int(props.get("vocab", 2))
    inputs = {i.name: i for i in m.graph.input}
    dims = inputs["input_ids"].type.tensor_type.shape.dim
    batch = dims[0].dim_value or batch
    seq = dims[1].dim_value or seq
    np_dt = helper.tensor_dtype_to_np_dtype(inputs["attention_mask"].type.tensor_type.elem_type)
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, size=(batch, seq), dtype=np.int64)
    mask = np.triu(np.full((seq, seq), np.finfo(np_dt).min, dtype=np_dt), k=1)
    mask = np.broadcast_to(mask, (batch, 1, seq, seq)).copy()
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    return sess.run(["logits"], {"input_ids": ids, "attention_mask": mask})[0]


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.2f} MiB"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-o", "--out-dir", required=True, type=Path, help="folder to write the models into")
    ap.add_argument("--preset", action="append", choices=[*PRESETS, "all"],
                    help="a preset (repeatable; 'all' for every one); dims given below override it")
    ap.add_argument("--name", help="file name (default: the preset's, e.g. llama7b.onnx; llama_custom.onnx)")
    for dim in ("layers", "hidden", "heads", "kv-heads", "intermediate", "vocab", "seq", "batch", "seed"):
        ap.add_argument(f"--{dim}", type=int)
    ap.add_argument("--dtype", choices=sorted(_DTYPES))
    ap.add_argument("--weights", choices=["sparse", "random"])
    ap.add_argument("--external", action="store_true", help="random weights: put them in the data file too")
    ap.add_argument("--no-check", action="store_true", help="skip onnx.checker.check_model")
    ap.add_argument("--smoke", action="store_true",
                    help="run each model in onnxruntime on random inputs (refused over 1 GiB of weights)")
    args = ap.parse_args(argv)

    presets = args.preset or [None]
    if "all" in presets:
        presets = list(PRESETS)
    if len(presets) > 1 and args.name:
        ap.error("--name with several presets")
    overrides = {k: getattr(args, k.replace("-", "_")) for k in
                 ("layers", "hidden", "heads", "kv-heads", "intermediate", "vocab", "seq", "batch", "seed",
                  "dtype", "weights")}
    overrides = {k.replace("-", "_"): v for k, v in overrides.items() if v is not None}
    status = 0
    for preset in presets:
        cfg = dict(PRESETS[preset]) if preset else {}
        cfg.update(overrides)
        missing = [k for k in ("layers", "hidden", "heads", "intermediate", "vocab") if k not in cfg]
        if missing:
            ap.error(f"without --preset give --{' --'.join(missing)}")
        cfg.setdefault("dtype", "float32")
        cfg.setdefault("weights", "random")
        name = args.name or (PRESET_FILES[preset] if preset else "llama_custom.onnx")
        t0 = time.perf_counter()
        path = make_llama_graph(args.out_dir / name, external=args.external, **cfg)
        dt = time.perf_counter() - t0
        info = describe(path)
        line = (f"{path}: {info['nodes']:,} nodes, {info['initializers']:,} initializers, weights "
                f"{info['weight_bytes']:,} B ({_gib(info['weight_bytes'])}), .onnx {_gib(info['onnx_bytes'])}")
        if "data_apparent_bytes" in info:
            line += (f", data file {_gib(info['data_apparent_bytes'])} apparent / "
                     f"{_gib(info['data_disk_bytes'])} on disk")
        print(line + f"; written in {dt:.2f} s", flush=True)
        if not args.no_check:
            t0 = time.perf_counter()
            onnx.checker.check_model(str(path))
            print(f"  onnx.checker.check_model: ok ({time.perf_counter() - t0:.2f} s)", flush=True)
        if args.smoke:
            if info["weight_bytes"] > 2**30:
                print("  --smoke: skipped, over 1 GiB of weights", flush=True)
                continue
            y = smoke_run(path)
            finite = bool(np.isfinite(y).all())
            print(f"  onnxruntime: logits {list(y.shape)} {y.dtype}, finite={finite}, "
                  f"std={float(np.std(y.astype(np.float64))):.4g}", flush=True)
            status |= 0 if finite else 1
    return status


if __name__ == "__main__":
    sys.exit(main())
