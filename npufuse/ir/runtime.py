"""Running models on stock onnxruntime, the way verification needs it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx
import onnxruntime as ort

from npufuse.ir.weights import is_external, iter_tensors

# IR 10 gives function overloads and node metadata (the fused node's provenance); onnxruntime >= 1.18
# reads it. Models npufuse builds never claim a newer IR than this.
IR_VERSION = 10


# Ops that draw random numbers; each takes an optional float `seed`.
_RANDOM_OPS = frozenset({"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial",
                         "Bernoulli"})
# The seed a random op without one is run with. Unseeded, onnxruntime draws differently for the same node in two
# models that differ elsewhere (a node added or removed before it): ViT-MAE's random patch shuffle then made the
# optimized model look like drift. Seeded alike, both sides draw the same numbers; the model file is not changed.
VERIFY_SEED = 0.0


def _seeded(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model`, or a copy of its structure with `seed` set on every random op that has none (subgraphs and
    functions included)."""
    def unseeded(nodes) -> bool:
        return any((n.op_type in _RANDOM_OPS and n.domain in ("", "ai.onnx") and
                    not any(a.name == "seed" for a in n.attribute)) or
                   any(unseeded(a.g.node) for a in n.attribute if a.type == onnx.AttributeProto.GRAPH) or
                   any(unseeded(g.node) for a in n.attribute for g in a.graphs) for n in nodes)

    if not (unseeded(model.graph.node) or any(unseeded(f.node) for f in model.functions)):
        return model
    copy = onnx.ModelProto()
    copy.CopyFrom(model)   # the structure: external weights stay references

    def seed(nodes) -> None:
        for n in nodes:
            if n.op_type in _RANDOM_OPS and n.domain in ("", "ai.onnx") and \
                    not any(a.name == "seed" for a in n.attribute):
                n.attribute.append(onnx.helper.make_attribute("seed", VERIFY_SEED))
            for a in n.attribute:
                if a.type == onnx.AttributeProto.GRAPH:
                    seed(a.g.node)
                for g in a.graphs:
                    seed(g.node)

    seed(copy.graph.node)
    for f in copy.functions:
        seed(f.node)
    return copy


def session(model: onnx.ModelProto, optimize: bool = False, base_dir: str | None = None) -> ort.InferenceSession:
    """An onnxruntime CPU session; graph optimizations off by default so ORT's own fusions hide nothing.
    External data is read by onnxruntime itself from `base_dir` (nothing is written there). A model that
    mentions bfloat16 runs as an fp32 copy (see verify.widen: onnxruntime has no bf16 kernels for most ops).
    Random ops without a seed run with VERIFY_SEED, so that two models draw alike."""
    from npufuse.ir import widen

    model = _seeded(model)

    if widen.mentions_bf16(model):
        copy, weights = widen.widen(model, base_dir)
        values = [ort.OrtValue.ortvalue_from_numpy(a) for a in weights.values()]
        so = _options(copy, optimize, base_dir)
        if weights:
            so.add_external_initializers(list(weights), values)
        sess = ort.InferenceSession(copy.SerializeToString(), so, providers=["CPUExecutionProvider"])
        return widen.WidenedSession(model, sess, [values, weights])
    return ort.InferenceSession(model.SerializeToString(), _options(model, optimize, base_dir),
                                providers=["CPUExecutionProvider"])


def _options(model: onnx.ModelProto, optimize: bool, base_dir: str | None) -> ort.SessionOptions:
    so = ort.SessionOptions()
    so.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimize
                                   else ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    so.log_severity_level = 4  # FATAL only: our own errors are one line; onnxruntime's would be dozens
    so.intra_op_num_threads = 0
    # Each session runs once (a check, a segment): packing weights for faster repeated MatMuls would only
    # hold a second copy of them.
    so.add_session_config_entry("session.disable_prepacking", "1")
    so.enable_cpu_mem_arena = False   # nor would an arena sized for repeated runs: memory goes back when freed
    if base_dir is not None and any(is_external(t) for t in iter_tensors(model)):
        so.add_session_config_entry("session.model_external_initializers_file_folder_path", str(base_dir))
    return so


def run(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray], outputs: Sequence[str] | None = None,
        base_dir: str | None = None) -> dict[str, np.ndarray]:
    """Run `model` on `feeds`; returns {output name: array}."""
    sess = session(model, base_dir=base_dir)
    names = list(outputs) if outputs is not None else [o.name for o in sess.get_outputs()]
    wanted = {i.name for i in sess.get_inputs()}
    res = sess.run(names, {k: v for k, v in feeds.items() if k in wanted})
    return dict(zip(names, res))



def release_freed_memory() -> None:
    """Hand memory freed by the C heap back to the OS (glibc's malloc_trim). Segment after segment, big
    short-lived buffers (weights, activations) otherwise leave the heap fragmented and the resident set growing
    by a segment's worth each time. A no-op where there is no glibc."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            import ctypes

            _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim = None
