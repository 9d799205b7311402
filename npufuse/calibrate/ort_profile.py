"""Per-node times measured by onnxruntime's own profiler, for checking the cost model on a CPU we have.

`node_times_us(model, feeds)` runs the model on onnxruntime's CPU provider with profiling on and returns each graph
node's median kernel time over the timed runs, by node name. The settings make one graph node one kernel, so the
names match the graph the cost model priced:
- graph optimisations off (ORT_DISABLE_ALL): onnxruntime would otherwise fuse nodes (MatMul+Add -> Gemm, its own
  LayerNorm/Gelu fusions) or fold them away, and the trace would name kernels the priced graph does not have;
- sequential execution and a fixed number of intra-op threads: the per-node times do not depend on what else runs.
The times are each node's "<name>_kernel_time" event `dur` (microseconds) in the Chrome-trace JSON the profiler
writes; the warm-up runs are left out.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping

import numpy as np
import onnx

KERNEL_SUFFIX = "_kernel_time"


def session_options(threads: int, profile_prefix: str | None = None):
    """onnxruntime session options for a per-node measurement: no graph rewrites, sequential, fixed threads."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    if profile_prefix is not None:
        so.enable_profiling = True
        so.profile_file_prefix = profile_prefix
    return so


def node_times_us(model: onnx.ModelProto | bytes, feeds: Mapping[str, np.ndarray], threads: int = 2,
                  warmup: int = 3, runs: int = 10) -> dict[str, float]:
    """Median kernel time (µs) of every node onnxruntime ran, by node name, over `runs` profiled runs."""
    import onnxruntime as ort

    data = model if isinstance(model, bytes) else model.SerializeToString()
    with tempfile.TemporaryDirectory(prefix="npufuse_ortprof_") as tmp:
        sess = ort.InferenceSession(data, session_options(threads, os.path.join(tmp, "trace")),
                                    providers=["CPUExecutionProvider"])
        for _ in range(warmup):
            sess.run(None, dict(feeds))
        for _ in range(runs):
            sess.run(None, dict(feeds))
        path = sess.end_profiling()
        with open(path, encoding="utf-8") as f:
            events = json.load(f)
    return median_times(events, skip_runs=warmup)


def median_times(events: list[dict], skip_runs: int = 0) -> dict[str, float]:
    """Per-node median `dur` of the "<name>_kernel_time" Node events, leaving out each node's first `skip_runs`
    occurrences (the warm-up runs: every run executes every node once, in order)."""
    per: dict[str, list[float]] = {}
    for e in events:
        if e.get("cat") != "Node":
            continue
        name = str(e.get("name", ""))
        if not name.endswith(KERNEL_SUFFIX):
            continue
        per.setdefault(name[: -len(KERNEL_SUFFIX)], []).append(float(e.get("dur", 0.0)))
    out = {}
    for name, durs in per.items():
        timed = durs[skip_runs:] or durs
        out[name] = float(np.median(timed))
    return out


def spearman(a, b) -> float:
    """Spearman's rank correlation of two equal-length sequences (average ranks for ties); nan when either is
    constant or there are fewer than 3 pairs."""
    x = np.asarray(a, dtype=float)
    y = np.asarray(b, dtype=float)
    if x.shape != y.shape or x.size < 3:
        return float("nan")
    rx, ry = _ranks(x), _ranks(y)
    if rx.std() == 0 or ry.std() == 0:
        return float("nan")
    return float(np.corrcoef(rx, ry)[0, 1])


def _ranks(v: np.ndarray) -> np.ndarray:
    """1-based ranks, ties given the mean of the ranks they span."""
    order = np.argsort(v, kind="mergesort")
    ranks = np.empty(v.size, dtype=float)
    ranks[order] = np.arange(1, v.size + 1, dtype=float)
    _, inverse, counts = np.unique(v, return_inverse=True, return_counts=True)
    sums = np.bincount(inverse, weights=ranks)
    return (sums / counts)[inverse]
