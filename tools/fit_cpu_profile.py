"""Measure this machine's CPU with onnxruntime and write it as an npufuse hardware profile (the NPU model's terms).

    python tools/fit_cpu_profile.py [--threads 2] [-o npufuse/npu_model/profiles/CPU2Core.toml]

The profile is for a structural check of the cost model on hardware we have (benchmarks/bench_cost_rank.py): it is
not an Ascend part, so each NPU field is mapped to the CPU quantity that plays its role, measured the way the
benchmark measures nodes (onnxruntime CPU provider, graph optimisations off, sequential, `--threads` intra-op
threads, per-node `dur` from the profiler, median over the timed runs; see npufuse/calibrate/ort_profile.py):

- "Cube" = the cores' SIMD FMA throughput as onnxruntime's fp32 MatMul achieves it (a 1024^3 MatMul, best of 3 medians);
- "Vector" = elementwise throughput on cache-resident data (a chain of Adds whose operands fit L2), and each
  vector instruction class's cost relative to Add from the same chain with that op;
- "GM bandwidth" = memory bandwidth as a large Add sees it (operands far larger than L3), all threads (chip) and
  one thread (per core); "L2 bandwidth" = the same with operands that fit L3 (the CPU's shared last-level cache);
- UB and L1 = L2 per core, L0A/L0B/L0C = L1d per core, L2 = L3 (from /sys/devices/system/cpu/cpu0/cache);
- launch = onnxruntime's per-node time for a one-element Add (the fixed cost of a kernel).
Fields with no CPU meaning get the neutral value, and the file's comments say so.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from npufuse.calibrate.ort_profile import node_times_us  # noqa: E402

DEFAULT_OUT = ROOT / "npufuse" / "npu_model" / "profiles" / "CPU2Core.toml"
CHAIN = 16          # nodes per chain: the median over them and over the runs damps a shared machine's noise
CHAIN_OPS = {"add": "Add", "div": "Div", "exp": "Exp", "ln": "Log", "sqrt": "Sqrt", "reciprocal": "Reciprocal",
             "erf": "Erf", "tanh": "Tanh"}


# ---- the machine -----------------------------------------------------------------------------------------------

def cache_sizes() -> dict[int, int]:
    """Per-core data cache size in bytes by level (1: L1d, 2: L2, 3: L3 shared), from sysfs."""
    out: dict[int, int] = {}
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    for idx in sorted(base.glob("index*")):
        kind = (idx / "type").read_text().strip()
        if kind == "Instruction":
            continue
        level = int((idx / "level").read_text())
        size = (idx / "size").read_text().strip()
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1], 1)
        out[level] = int(size.rstrip("KMG")) * mult
    return out


def line_bytes() -> int:
    p = Path("/sys/devices/system/cpu/cpu0/cache/index0/coherency_line_size")
    return int(p.read_text()) if p.exists() else 64


def clock_hz() -> float:
    """The nominal clock /proc/cpuinfo reports (a VM reports the host's base clock; turbo is not visible)."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("cpu MHz"):
            return float(line.split(":")[1]) * 1e6
    raise SystemExit("fit_cpu_profile: /proc/cpuinfo has no 'cpu MHz' line; this script needs Linux")


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


# ---- measurements ----------------------------------------------------------------------------------------------

def _model(nodes, inputs, outputs) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "m", inputs, outputs)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _vi(name: str, shape) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, list(shape))


def chain_time_us(op: str, elems: int, threads: int, runs: int = 20) -> float:
    """Median per-node time of a chain of `op` nodes on `elems` fp32 elements (binary ops take `b` as the second
    operand). Positive inputs keep Log/Sqrt/Div finite."""
    binary = op in ("Add", "Div")
    nodes, prev = [], "x"
    for i in range(CHAIN):
        out = f"y{i}"
        nodes.append(helper.make_node(op, [prev, "b"] if binary else [prev], [out], name=f"n{i}"))
        prev = out
    ins = [_vi("x", [elems])] + ([_vi("b", [elems])] if binary else [])
    m = _model(nodes, ins, [_vi(prev, [elems])])
    feeds = {"x": np.full(elems, 1.0001, np.float32)}
    if binary:
        feeds["b"] = np.full(elems, 1.0001, np.float32)
    times = node_times_us(m, feeds, threads=threads, warmup=3, runs=runs)
    return float(np.median([times[f"n{i}"] for i in range(CHAIN)]))


def reduce_time_us(elems: int, threads: int, runs: int = 20) -> float:
    rows = elems // 256
    nodes = [helper.make_node("ReduceSum", ["x", "axes"], [f"y{i}"], name=f"n{i}", keepdims=1) for i in range(CHAIN)]
    m = _model(nodes, [_vi("x", [rows, 256])], [_vi(f"y{i}", [rows, 1]) for i in range(CHAIN)])
    m.graph.initializer.append(helper.make_tensor("axes", TensorProto.INT64, [1], [1]))
    times = node_times_us(m, {"x": np.ones((rows, 256), np.float32)}, threads=threads, warmup=3, runs=runs)
    return float(np.median([times[f"n{i}"] for i in range(CHAIN)]))


def matmul_time_us(n: int, threads: int, runs: int = 7) -> float:
    m = _model([helper.make_node("MatMul", ["a", "b"], ["c"], name="mm")], [_vi("a", [n, n]), _vi("b", [n, n])],
               [_vi("c", [n, n])])
    rng = np.random.default_rng(0)
    feeds = {k: rng.standard_normal((n, n)).astype(np.float32) for k in ("a", "b")}
    return node_times_us(m, feeds, threads=threads, warmup=2, runs=runs)["mm"]


def add_time_us(elems: int, threads: int, runs: int = 7) -> float:
    """One Add on `elems` elements (for bandwidth: read two operands, write one)."""
    m = _model([helper.make_node("Add", ["a", "b"], ["c"], name="add")], [_vi("a", [elems]), _vi("b", [elems])],
               [_vi("c", [elems])])
    feeds = {k: np.ones(elems, np.float32) for k in ("a", "b")}
    return node_times_us(m, feeds, threads=threads, warmup=2, runs=runs)["add"]


def best_of(measure_us, tries: int = 3) -> float:
    """The lowest of a few medians: on a machine other jobs share, the quietest try is nearest the hardware."""
    return min(measure_us() for _ in range(tries))


def measure(threads: int) -> dict:
    caches = cache_sizes()
    l1d, l2, l3 = caches.get(1, 32 << 10), caches.get(2, 1 << 20), caches.get(3, 32 << 20)
    clk = clock_hz()
    r: dict = {"threads": threads, "clock_hz": clk, "l1d": l1d, "l2": l2, "l3": l3, "line": line_bytes()}
    r["launch_us"] = chain_time_us("Add", 1, threads)
    mm_n = 1024
    t = best_of(lambda: matmul_time_us(mm_n, threads))
    r["matmul"] = {"n": mm_n, "us": t, "flops_per_s": 2.0 * mm_n ** 3 / (t * 1e-6)}
    # cache-resident elementwise: x, b and y of each core's share inside its L2 (a quarter of it each)
    v_elems = (l2 // 4 // 4) * threads
    per_op = {cls: chain_time_us(op, v_elems, threads) for cls, op in CHAIN_OPS.items()}
    per_op["reduce"] = reduce_time_us(v_elems, threads)
    r["vector"] = {"elems": v_elems, "us": per_op}
    # memory: three operands of 4x L3 each; last-level cache: three operands filling half of L3 together
    big = 4 * l3 // 4
    r["gm"] = {"elems": big, "us_all": best_of(lambda: add_time_us(big, threads)),
               "us_one": best_of(lambda: add_time_us(big, 1))}
    mid = l3 // 2 // 3 // 4
    r["llc"] = {"elems": mid, "us_all": add_time_us(mid, threads, runs=20)}
    return r


# ---- the profile -----------------------------------------------------------------------------------------------

def profile_toml(r: dict, name: str, cmd: str) -> str:
    threads, clk, launch = r["threads"], r["clock_hz"], r["launch_us"]
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    machine = f"{cpu_name()}, {os.cpu_count()} logical CPUs, {platform.system()} {platform.release()}"
    prov = f"measured by `{cmd}` on {when} ({machine}; onnxruntime CPU provider, {threads} intra-op threads)"
    macs_core = r["matmul"]["flops_per_s"] / 2.0 / threads / clk
    fp32_macs = max(1, round(macs_core))
    ve = r["vector"]["elems"]
    add_us = max(r["vector"]["us"]["add"] - launch, 1e-3)
    # bytes of one operand per cycle per core: the cost model's Vector does ceil(elems*itemsize / bytes) repeats
    vec_bytes = max(1, round(ve * 4 / threads / (add_us * 1e-6) / clk))
    costs = {cls: max(0.05, (us - launch) / add_us) for cls, us in r["vector"]["us"].items()}
    costs["rsqrt"] = costs["sqrt"] + costs["reciprocal"]    # ONNX has no Rsqrt: Sqrt then Reciprocal, two kernels
    gm_bytes = 3 * 4 * r["gm"]["elems"]
    gm_all = gm_bytes / (r["gm"]["us_all"] * 1e-6)
    gm_one_cycle = gm_bytes / (r["gm"]["us_one"] * 1e-6) / clk
    l3_all = 3 * 4 * r["llc"]["elems"] / (max(r["llc"]["us_all"] - launch, 1e-3) * 1e-6)
    mm = r["matmul"]
    lines = [
        f"# {name}: this machine's CPU ({cpu_name()}, {threads} cores used) in the NPU model's terms, for the",
        "# structural check of the cost model (benchmarks/bench_cost_rank.py: rank correlation of modeled and",
        "# measured per-node times). Written by tools/fit_cpu_profile.py; re-run it on another machine rather than",
        "# editing numbers by hand. It is NOT an Ascend part: 'Cube' is the SIMD FMA path as onnxruntime's fp32",
        "# MatMul uses it, 'Vector' the elementwise path, 'GM' main memory, 'UB'/'L1' the per-core L2 cache,",
        "# 'L0*' the L1d cache, 'L2' the shared L3. Fields with no CPU meaning carry the neutral value (comment).",
        f'name = "{name}"',
        f'description = "{cpu_name()}: {threads} cores at {clk / 1e9:.2f} GHz as onnxruntime runs them '
        f'(CPU provider, {threads} threads), measured {when[:10]}"',
        "# no `chip`: a CPU has no Ascend kernel catalogue, so every kernel is taken as available",
        'precision_mode = "must_keep_origin_dtype"  # onnxruntime runs the graph in its own dtypes',
        "",
        "[cores]",
        f"cube_cores = {threads}                     # onnxruntime intra-op threads, one per core",
        f"vector_cores = {threads}                   # the same cores run elementwise work",
        f"clock_hz = {clk:.6g}",
        'cube_to_vector_path = "direct"     # a fused epilogue reads the GEMM result from cache, no hand-off',
        "",
        "[cube]",
        f"fp16_macs_per_cycle = {fp32_macs}          # neutral: not measured (fixtures are fp32); the fp32 rate",
        f"bf16_macs_per_cycle = {fp32_macs}          # neutral: not measured; the fp32 rate",
        f"fp32_macs_per_cycle = {fp32_macs}          # measured: fp32 MatMul {mm['n']}^3, "
        f"{mm['flops_per_s'] / 1e9:.1f} GFLOP/s over {threads} cores",
        f"int8_macs_per_cycle = {fp32_macs}          # neutral: not measured; the fp32 rate",
        "block = 1                          # neutral: no fractal padding on a CPU (MLAS packs panels itself)",
        "",
        "[vector]",
        f"bytes_per_cycle = {vec_bytes}                # measured: cache-resident Add, per core",
        "",
        "[vector.repeat_cost]               # measured: each op's per-element time over Add's, cache-resident",
    ]
    for cls in ("add", "div", "exp", "ln", "sqrt", "rsqrt", "reciprocal", "erf", "tanh", "reduce"):
        lines.append(f"{cls} = {costs[cls]:.3g}")
    lines += [
        "",
        "[memory]",
        f"ub_bytes = {r['l2']}                 # L2 per core",
        f"l1_bytes = {r['l2']}                 # L2 per core (the GEMM's operand panels live there too)",
        f"l0a_bytes = {r['l1d']}                 # L1d per core",
        f"l0b_bytes = {r['l1d']}                 # L1d per core",
        f"l0c_bytes = {r['l1d']}                 # L1d per core (accumulators are registers; neutral: L1d)",
        f"l2_bytes = {r['l3']}                # L3, shared",
        f"alignment_bytes = {r['line']}               # cache line",
        "",
        "[bandwidth]",
        f"gm_read_bytes_per_cycle_per_core = {gm_one_cycle:.3g}   # measured: one thread, Add far beyond L3",
        f"ub_to_gm_bytes_per_cycle_per_core = {gm_one_cycle:.3g}  # neutral: the same stream (writes not "
        "measured apart)",
        f"gm_bandwidth_bytes_per_s = {gm_all:.4g}      # measured: {threads} threads, Add far beyond L3",
        f"l2_bandwidth_bytes_per_s = {l3_all:.4g}      # measured: {threads} threads, Add inside L3",
        "",
        "[launch]",
        f"kernel_launch_us = {launch:.3g}             # measured: one-element Add, onnxruntime per-node time",
        "",
        "[sources]",
        '"precision_mode" = "onnxruntime\'s CPU provider runs every op in the dtype of the graph"',
        '"chip" = "not set: a CPU has no Ascend kernel catalogue; every kernel is taken as available"',
        f'"cores.cube_cores" = "onnxruntime intra-op threads used by the measurement ({threads}), one per core"',
        f'"cores.vector_cores" = "the same {threads} cores"',
        f'"cores.clock_hz" = "/proc/cpuinfo cpu MHz ({clk / 1e6:.0f}); {prov}"',
        '"cores.cube_to_vector_path" = "CPU: an epilogue reads the GEMM result from cache, no hand-off (direct)"',
        f'"cube.fp32_macs_per_cycle" = "fp32 MatMul {mm["n"]}^3 took {mm["us"]:.0f} us = '
        f'{mm["flops_per_s"] / 1e9:.1f} GFLOP/s / 2 / {threads} cores / clock; {prov}"',
        '"cube.fp16_macs_per_cycle" = "neutral, not measured: the fp32 rate"',
        '"cube.bf16_macs_per_cycle" = "neutral, not measured: the fp32 rate"',
        '"cube.int8_macs_per_cycle" = "neutral, not measured: the fp32 rate"',
        '"cube.block" = "neutral: 1 (no fractal padding on a CPU)"',
        f'"vector.bytes_per_cycle" = "chain of Adds on {ve} fp32 elements (inside L2 per core): '
        f'{r["vector"]["us"]["add"]:.1f} us per node less the launch; {prov}"',
    ]
    for cls in ("add", "div", "exp", "ln", "sqrt", "reciprocal", "erf", "tanh", "reduce"):
        op = CHAIN_OPS.get(cls, "ReduceSum over rows of 256")
        lines.append(f'"vector.repeat_cost.{cls}" = "chain of {op} on {ve} elements: '
                     f'{r["vector"]["us"][cls]:.1f} us per node, (t - launch) / (t_Add - launch); {prov}"')
    lines += [
        '"vector.repeat_cost.rsqrt" = "ONNX has no Rsqrt: the sum of the measured Sqrt and Reciprocal costs"',
        f'"memory.ub_bytes" = "L2 per core, /sys/devices/system/cpu/cpu0/cache ({r["l2"]} B)"',
        f'"memory.l1_bytes" = "L2 per core, /sys/devices/system/cpu/cpu0/cache ({r["l2"]} B)"',
        f'"memory.l0a_bytes" = "L1d per core, /sys/devices/system/cpu/cpu0/cache ({r["l1d"]} B)"',
        f'"memory.l0b_bytes" = "L1d per core, /sys/devices/system/cpu/cpu0/cache ({r["l1d"]} B)"',
        '"memory.l0c_bytes" = "neutral: L1d per core (a CPU accumulates in registers)"',
        f'"memory.l2_bytes" = "L3 (shared), /sys/devices/system/cpu/cpu0/cache ({r["l3"]} B)"',
        '"memory.alignment_bytes" = "cache line, /sys/devices/system/cpu/cpu0/cache/index0/coherency_line_size"',
        f'"bandwidth.gm_read_bytes_per_cycle_per_core" = "Add of 3 x {4 * r["gm"]["elems"] >> 20} MiB, 1 thread: '
        f'{r["gm"]["us_one"]:.0f} us; {prov}"',
        '"bandwidth.ub_to_gm_bytes_per_cycle_per_core" = "neutral: taken equal to the measured per-core read rate"',
        f'"bandwidth.gm_bandwidth_bytes_per_s" = "Add of 3 x {4 * r["gm"]["elems"] >> 20} MiB, {threads} threads: '
        f'{r["gm"]["us_all"]:.0f} us; {prov}"',
        f'"bandwidth.l2_bandwidth_bytes_per_s" = "Add of 3 x {4 * r["llc"]["elems"] >> 10} KiB (inside L3), '
        f'{threads} threads: {r["llc"]["us_all"]:.0f} us less the launch; {prov}"',
        f'"launch.kernel_launch_us" = "chain of one-element Adds: median per-node time; {prov}"',
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2, help="onnxruntime intra-op threads (cores used)")
    ap.add_argument("--name", default="CPU2Core")
    ap.add_argument("-o", "--output", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    cmd = "python tools/fit_cpu_profile.py" + (f" --threads {args.threads}" if args.threads != 2 else "")
    r = measure(args.threads)
    text = profile_toml(r, args.name, cmd)
    tmp = args.output.with_suffix(".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, args.output)
    print(text)
    print(f"wrote {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
