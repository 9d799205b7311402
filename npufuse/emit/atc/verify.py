"""The ATC form checked against the original: the same seeded inputs, the original on onnxruntime (segment by
segment, as every whole-model check), the ATC form with its standard ops on onnxruntime too and each plugin node
on a NumPy kernel of what the CANN kernel computes as its plugin configures it (`reference_kernels`): the runs of
standard ops between plugin nodes are cut into models of their own. Every output is compared with the
dtype-aware tolerances of `npufuse check`. (onnx's reference evaluator, `evaluator.run_atc_model`, runs the same
form in one piece, but it fails on ops it implements wrongly, GatherElements among them, and is slow.)"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import onnx
from onnx import external_data_helper

from onnx import helper

from npufuse.emit.atc.evaluator import normalise_domains
from npufuse.emit.atc.plugins import plugin_attrs
from npufuse.emit.atc.reference_kernels import KERNELS
from npufuse.ir.graph import Graph, _node_value_inputs
from npufuse.ir.runtime import IR_VERSION, session
from npufuse.ir.weights import is_external
from npufuse.verify.compare import Verdict
from npufuse.verify.inputs import model_inputs
from npufuse.verify import precision, selection
from npufuse.verify.whole import capture, compare_outputs, run_model


def _with_weights(model: onnx.ModelProto, base_dir: str | None) -> onnx.ModelProto:
    """A copy the reference evaluator can run: external weights read in (verification only; never written)."""
    if not any(is_external(t) for t in model.graph.initializer):
        return model
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    external_data_helper.load_external_data_for_model(copy, base_dir or ".")
    return copy


def verify_atc(original: onnx.ModelProto, atc_model: onnx.ModelProto, base_dir: str | None, *, seed: int = 0,
               dims: Mapping[str, int] | None = None,
               reference_outputs: Mapping[str, np.ndarray] | None = None,
               user_nodes: Mapping[str, UserNodeKernel] | None = None) -> Verdict:
    """Original vs ATC form on the same seeded inputs, every output of the original. `user_nodes`: by node name,
    the kernel of each user plugin node (`--kernels`): the reference kernel of the npufuse op it implements."""
    g = Graph(original, base_dir)
    feeds = model_inputs(g, seed, dims)
    want = dict(reference_outputs) if reference_outputs is not None else run_model(original, feeds, base_dir)
    runnable = normalise_domains(_with_weights(atc_model, base_dir))
    inputs = {i.name for i in atc_model.graph.input}
    fed = {k: v for k, v in feeds.items() if k in inputs}
    got = run_segments(runnable, fed, user_nodes)

    def exact() -> dict[str, np.ndarray] | None:   # float16 outputs: rounding told from drift (verify.precision)
        wide = precision.fp32_copy(original)
        return None if wide is None else run_model(wide, precision.widen_feeds(feeds), base_dir)

    check = precision.settle(compare_outputs(got, want), got, want, exact)
    chosen = selection.selection_nodes(runnable)
    if check.ok or not chosen:
        return check
    # a selection's tie-break told from drift (verify.selection): the original's values at the selections
    names = [o for n in chosen for o in n.output if o] + [n.input[0] for n in chosen]
    try:
        values = capture(g, feeds, names)
    except Exception:   # noqa: BLE001 - a name the original lacks: the plain verdict stands
        return check
    return selection.settle(check, runnable, fed, want, values.get,
                            lambda model, f: run_segments(model, f, user_nodes))[0]


# A user plugin node's kernel: the node's input arrays (None where absent) -> its outputs.
UserNodeKernel = Callable[[list], list]


def _is_plugin(node: onnx.NodeProto) -> bool:
    return node.op_type in KERNELS and node.domain in ("npu", "")


def run_segments(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray],
                 user_nodes: Mapping[str, UserNodeKernel] | None = None) -> dict[str, np.ndarray]:
    """The outputs of an ATC-form `model` (default domain "", weights loaded): runs of standard ops on onnxruntime,
    plugin nodes on their NumPy kernels (a user plugin node, by name, on `user_nodes`), in the model's order."""
    user_nodes = user_nodes or {}
    env: dict[str, np.ndarray] = dict(feeds)
    inits = {t.name: t for t in model.graph.initializer}
    opsets = [o for o in model.opset_import if o.domain in ("", "ai.onnx")]
    run: list[onnx.NodeProto] = []

    def flush() -> None:
        if not run:
            return
        produced = [v for n in run for v in n.output if v]
        reads = [v for n in run for v in _node_value_inputs(n)]
        made = set(produced)
        outside = list(dict.fromkeys(v for v in reads if v not in made and v not in inits))
        g = helper.make_graph(
            run, "segment",
            [helper.make_tensor_value_info(v, helper.np_dtype_to_tensor_dtype(env[v].dtype), env[v].shape)
             for v in outside],
            [onnx.ValueInfoProto(name=v) for v in produced],
            [inits[v] for v in dict.fromkeys(reads) if v in inits and v not in made])
        seg = helper.make_model(g, opset_imports=opsets, ir_version=min(model.ir_version or IR_VERSION, IR_VERSION))
        values = session(seg).run(produced, {v: env[v] for v in outside})
        env.update(zip(produced, values))
        run.clear()

    for node in model.graph.node:
        user = user_nodes.get(node.name) if node.domain not in ("", "ai.onnx") else None
        if user is None and not _is_plugin(node):
            run.append(node)
            continue
        flush()
        args = [None if not v else _value(v, env, inits) for v in node.input]
        outs = user(args) if user is not None else \
            KERNELS[node.op_type](args, {k: v for k, v in plugin_attrs(node).items() if v is not None})
        env.update((v, o) for v, o in zip(node.output, outs) if v)
    flush()
    return {o.name: env[o.name] for o in model.graph.output}


def _value(name: str, env: Mapping[str, np.ndarray], inits: Mapping[str, onnx.TensorProto]) -> np.ndarray:
    if name in env:
        return env[name]
    return onnx.numpy_helper.to_array(inits[name])
