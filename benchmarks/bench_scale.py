#!/usr/bin/env python3
"""Memory and time of `npufuse optimize` at scale (7B / 1.1B Llama, a 100k-node graph, BERT-base beside
its peers): medians of --runs fresh subprocesses per case.

Reproduce (from the repository root, in the venv; writes benchmarks/results/scale.json)::

    python benchmarks/bench_scale.py                              # every case, 3 runs each
    python benchmarks/bench_scale.py --case 100k-noverify --case 'bert-*' --runs 5
    python benchmarks/bench_scale.py --case 7b-verify --npufuse-arg=--verify-memory=1GiB

Cases (``--case`` takes names or shell patterns, repeatable; default all); OUT is a temp folder under
benchmarks/.cache/, removed after each run; targets are judged on the medians:

  7b-noverify            npufuse optimize llama7b.onnx -o OUT -q --no-verify          peak RSS < 1 GiB, wall < 30 s
  7b-verify              npufuse optimize llama7b.onnx -o OUT -q --dim batch=1 --dim seq=128   peak RSS < 3 GiB
  1b-verify              npufuse optimize llama1b.onnx -o OUT -q --dim batch=1 --dim seq=128   peak RSS < 2 GiB
  100k-noverify          npufuse optimize llama100k.onnx -o OUT -q --no-verify        wall < 20 s, and < 5x 100k-onnx's
  100k-onnx              onnx.save(onnx.shape_inference.infer_shapes(onnx.load(path, load_external_data=False)), OUT)
                         (the reference: what onnx itself takes to read, shape-infer and write the same graph)
  100k-report            npufuse optimize llama100k.onnx -o OUT -q --no-verify --report OUT.report.json
                         (no target: what the JSON report a user reads adds)
  bert-npufuse-noverify  npufuse optimize bert_base_ts17.onnx -o OUT -q --no-verify   (compared, no target)
  bert-npufuse-verify    npufuse optimize bert_base_ts17.onnx -o OUT -q               (compared, no target)
  bert-ort               onnxruntime.transformers.optimizer.optimize_model(path, model_type='bert', num_heads=12,
                         hidden_size=768, opt_level=0, use_gpu=False).save_model_to_file(OUT)
  bert-onnxscript        onnx_ir.save(onnxscript.rewriter.ort_fusions.optimize_for_ort(onnx_ir.load(path))[0], OUT)

The BERT cases print ratios: npufuse --no-verify time / the faster peer's, and npufuse's peak RSS / the model
file's size. With both 100k cases selected, the ratio of their median wall times (and work times) is printed and
recorded as ``onnx_reference_ratio``: npufuse's target is 5x what onnx takes for load + shape inference + save. ``--npufuse-arg`` (repeatable) appends arguments to every npufuse command (e.g.
``--verify-memory=1GiB`` once the CLI has it). npufuse is imported from this checkout (``--npufuse-src DIR``
puts another source tree first on PYTHONPATH instead, e.g. ``git archive HEAD npufuse | tar -x -C /tmp/head``
for a before/after comparison); the venv's own ``npufuse`` script may be a stale non-editable install, so it
is not what runs. Each run records the ``npufuse/__init__.py`` it imported.

Models (generated once into benchmarks/.cache/, gitignored, and reused; regenerated when missing or older
than their generator):

* ``llama7b.onnx`` / ``llama1b.onnx`` / ``llama100k.onnx``: ``tools/make_llm_graphs.py --preset 7b|1b|100k``
  (Llama-shaped graphs whose weights are a sparse external data file: 12.6 GiB / 4.1 GiB / 100 MiB apparent
  size, ~0 on disk, reading as zeros);
* ``bert_base_ts17.onnx``: ``transformers.BertModel(BertConfig())`` (12 layers, hidden 768, 12 heads, eager
  attention, no pooler), seeded random weights, exported by TorchScript
  (``torch.onnx.export(..., dynamo=False, opset_version=17)``, dynamic batch/sequence, weights embedded,
  ~436 MB). Needs ``pip install torch==2.13.0 transformers`` (only to build it; the check against torch is
  printed when built).

Method. Every run is a fresh ``python`` subprocess (``sys.executable``, so the venv's) running a small driver:
npufuse's click command called in-process exactly as the ``npufuse`` script does, or the peer's Python API.
The driver imports the heavy modules first and reports ``import_s`` and ``work_s`` (load + optimize + save).

* ``wall_s``: measured here, from the spawn to the reaping of the child: what a user sees, interpreter
  start-up and imports included. The targets use it; ``work_s`` is shown beside it.
* peak RSS: the larger of two measurements of the child's process tree.
  (1) ``os.wait4(pid)``'s ``ru_maxrss``: the kernel's high-water mark of the child's resident set, exact (no
  sampling can miss a spike), and Linux folds in the high-water marks of every descendant the child reaped
  (getrusage RUSAGE_BOTH); it is a per-process maximum, not a sum. Because each run is reaped on its own
  with wait4, one big run cannot leak into the next run's number (as RUSAGE_CHILDREN of a long-lived parent
  would). (2) A poller thread sums VmRSS (and RssAnon, RssFile) over the child and all its descendants
  (psutil) every ``--poll-ms`` (20 ms): it sees processes that run at the same time, but can miss a spike
  shorter than the interval. npufuse and the peers are single processes, so (1) normally decides.
  RSS counts touched pages of memory-mapped files (RssFile) as well as anonymous memory (RssAnon): mapping
  the weights and reading them counts. The polled anonymous part is shown too (``anon`` column,
  ``poll_anon_bytes``) so the two can be told apart.
* A run that passes ``--kill-above`` (default 10 GiB, polled tree RSS) is killed with its process group and
  recorded as killed (target not met): the machine is shared.

Medians over --runs (default 3) of wall_s, work_s and peak RSS decide the targets; min/max are kept in the
JSON. Runs go round-robin over the selected cases (run 1 of every case, then run 2, ...), so drift on a shared
machine hits every case alike. Results (merged by case into an existing file) go to --json
(default benchmarks/results/scale.json) with versions, git revision and machine. Exit status 1 when a
selected case misses its target, else 0.
"""

from __future__ import annotations

import argparse
import datetime
import fnmatch
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / "benchmarks" / ".cache"
RESULTS = ROOT / "benchmarks" / "results" / "scale.json"
GENERATOR = ROOT / "tools" / "make_llm_graphs.py"
GiB = 2**30
MiB = 2**20

# ----------------------------------------------------------------------------- drivers (run in the child)
_PREAMBLE = """
import json, sys, time
_t0 = time.perf_counter()
"""
_REPORT = """
print("@@BENCH " + json.dumps({"import_s": _t1 - _t0, "work_s": _t2 - _t1, **_extra}), flush=True)
"""

# npufuse: the click command, in-process, exactly as the `npufuse` console script calls it
DRIVER_NPUFUSE = _PREAMBLE + """
import numpy, onnx, onnxruntime
import npufuse.fusion.engine, npufuse.ir.modelio, npufuse.reporting.summary
import npufuse
from npufuse.cli import main
_t1 = time.perf_counter()
_code = 0
try:
    main.main(args=sys.argv[1:], prog_name="npufuse", standalone_mode=True)
except SystemExit as e:
    _code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
_t2 = time.perf_counter()
_extra = {"rc": _code, "npufuse": npufuse.__file__}
""" + _REPORT + """
sys.exit(_code)
"""

DRIVER_ORT = _PREAMBLE + """
import onnx, onnxruntime
from onnxruntime.transformers.optimizer import optimize_model
src, out, num_heads, hidden = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
_t1 = time.perf_counter()
m = optimize_model(src, model_type="bert", num_heads=num_heads, hidden_size=hidden, opt_level=0,
                   use_gpu=False)
m.save_model_to_file(out)
_t2 = time.perf_counter()
try:
    _extra = {"fused": {k: v for k, v in m.get_fused_operator_statistics().items() if v}}
except Exception:
    _extra = {}
""" + _REPORT

# onnx itself: load the structure (weights stay in their data file), shape inference, save; npufuse's reference
DRIVER_ONNX = _PREAMBLE + """
import onnx
src, out = sys.argv[1], sys.argv[2]
_t1 = time.perf_counter()
m = onnx.load(src, load_external_data=False)
m = onnx.shape_inference.infer_shapes(m)
onnx.save(m, out)
_t2 = time.perf_counter()
_extra = {"nodes": len(m.graph.node)}
""" + _REPORT

DRIVER_ONNXSCRIPT = _PREAMBLE + """
import onnx, onnx_ir as ir
from onnxscript.rewriter.ort_fusions import optimize_for_ort
src, out = sys.argv[1], sys.argv[2]
_t1 = time.perf_counter()
model = ir.load(src)
model, counts = optimize_for_ort(model)
ir.save(model, out)
_t2 = time.perf_counter()
_extra = {"fused": {k: v for k, v in counts.items() if v}}
""" + _REPORT


# ----------------------------------------------------------------------------- models
def _stale(path: Path, *sources: Path) -> bool:
    if not path.exists():
        return True
    return any(s.exists() and s.stat().st_mtime > path.stat().st_mtime for s in sources)


def ensure_llama(preset: str, cache: Path) -> Path:
    name = {"7b": "llama7b.onnx", "1b": "llama1b.onnx", "100k": "llama100k.onnx"}[preset]
    path = cache / name
    data = path.with_name(path.name + ".data")
    if _stale(path, GENERATOR) or not data.exists():
        print(f"generating {path} ...", flush=True)
        subprocess.run([sys.executable, str(GENERATOR), "--preset", preset, "-o", str(cache), "--name", name],
                       check=True)
    return path


BERT_FILE = "bert_base_ts17.onnx"


def build_bert(path: Path) -> None:
    """BERT-base (BertModel(BertConfig()), eager attention, no pooler), seeded random weights, TorchScript
    export at opset 17 with dynamic batch/sequence; checked against torch in onnxruntime."""
    import warnings

    import numpy as np
    import onnxruntime as ort
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.BertConfig()            # bert-base: 12 layers, hidden 768, 12 heads, 3072, vocab 30522
    cfg._attn_implementation = "eager"
    model = transformers.BertModel(cfg, add_pooling_layer=False).eval()
    model.config._attn_implementation = "eager"

    class Wrap(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, input_ids, attention_mask, token_type_ids):
            return self.m(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                          return_dict=True).last_hidden_state

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=g)
    mask = torch.ones(2, 16, dtype=torch.int64)
    mask[1, -3:] = 0
    tt = torch.zeros(2, 16, dtype=torch.int64)
    tt[:, 8:] = 1
    names = ["input_ids", "attention_mask", "token_type_ids"]
    axes = {n: {0: "batch", 1: "sequence"} for n in [*names, "last_hidden_state"]}
    tmp = path.with_name(path.name + ".tmp")
    wrapped = Wrap(model).eval()   # eval: export() restores the wrapper's mode on the whole tree afterwards
    with torch.no_grad():
        ref = wrapped(ids, mask, tt).numpy()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(wrapped, (ids, mask, tt), str(tmp), input_names=names,
                          output_names=["last_hidden_state"], dynamic_axes=axes, opset_version=17, dynamo=False)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(str(tmp), so, providers=["CPUExecutionProvider"])
    got = sess.run(None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy(), "token_type_ids": tt.numpy()})[0]
    err = float(np.abs(got - ref).max())
    print(f"built {path} ({tmp.stat().st_size / MiB:.0f} MiB), torch {torch.__version__}, transformers "
          f"{transformers.__version__}; max |onnxruntime - torch| = {err:.2e}", flush=True)
    if err > 1e-3:
        raise SystemExit(f"BERT export drifts from torch ({err})")
    os.replace(tmp, path)


def ensure_bert(cache: Path) -> Path:
    path = cache / BERT_FILE
    if path.exists():
        return path
    missing = [m for m in ("torch", "transformers") if _find_spec(m) is None]
    if missing:
        raise SystemExit(f"bench_scale: the BERT cases build {path} once and need {' and '.join(missing)}: "
                         "pip install torch==2.13.0 transformers   (or leave them out: --case '7b-*' ...)")
    print(f"building {path} ...", flush=True)
    # in a subprocess: torch's memory must not stay in this process during the measurements
    subprocess.run([sys.executable, __file__, "--_build-bert", str(path)], check=True)
    return path


def _find_spec(name: str):
    import importlib.util

    return importlib.util.find_spec(name)


# ----------------------------------------------------------------------------- cases
@dataclass
class Case:
    name: str
    model: str                      # "7b" | "1b" | "100k" | "bert"
    tool: str                       # "npufuse" | "ort" | "onnxscript" | "onnx"
    npufuse_args: list[str] = field(default_factory=list)
    max_rss: int | None = None      # bytes
    max_wall: float | None = None   # seconds
    group: str | None = None        # cases compared side by side
    max_ratio: float | None = None  # wall must stay under this multiple of the `group`'s onnx reference case

    def target_text(self) -> str:
        parts = []
        if self.max_rss:
            parts.append(f"peak RSS < {self.max_rss / GiB:g} GiB")
        if self.max_wall:
            parts.append(f"wall < {self.max_wall:g} s")
        if self.max_ratio:
            parts.append(f"wall < {self.max_ratio:g}x {REFERENCE_CASE}")
        return ", ".join(parts) or ("the reference: compared" if self.tool == "onnx" else "no target: compared")


_VERIFY_DIMS = ["--dim", "batch=1", "--dim", "seq=128"]
REFERENCE_CASE = "100k-onnx"   # what 100k-noverify's `max_ratio` is a multiple of
CASES = [
    Case("7b-noverify", "7b", "npufuse", ["--no-verify"], max_rss=1 * GiB, max_wall=30),
    Case("7b-verify", "7b", "npufuse", _VERIFY_DIMS, max_rss=3 * GiB),
    Case("1b-verify", "1b", "npufuse", _VERIFY_DIMS, max_rss=2 * GiB),
    Case("100k-noverify", "100k", "npufuse", ["--no-verify"], max_wall=20, max_ratio=5),
    Case("100k-onnx", "100k", "onnx"),
    # the same with the JSON report a user reads: the whole model priced before and after, every fusion's record
    Case("100k-report", "100k", "npufuse", ["--no-verify", "--report", "{out}.report.json"]),
    Case("bert-npufuse-noverify", "bert", "npufuse", ["--no-verify"], group="bert"),
    Case("bert-npufuse-verify", "bert", "npufuse", [], group="bert"),
    Case("bert-ort", "bert", "ort", group="bert"),
    Case("bert-onnxscript", "bert", "onnxscript", group="bert"),
]


def command(case: Case, src: Path, out: Path, extra: list[str]) -> list[str]:
    if case.tool == "npufuse":
        return [sys.executable, "-c", DRIVER_NPUFUSE, "optimize", str(src), "-o", str(out), "-q",
                *[a.replace("{out}", str(out)) for a in case.npufuse_args], *extra]
    if case.tool == "ort":
        return [sys.executable, "-c", DRIVER_ORT, str(src), str(out), "12", "768"]
    if case.tool == "onnxscript":
        return [sys.executable, "-c", DRIVER_ONNXSCRIPT, str(src), str(out)]
    if case.tool == "onnx":
        return [sys.executable, "-c", DRIVER_ONNX, str(src), str(out)]
    raise ValueError(case.tool)


def shown_command(case: Case, src: Path, extra: list[str]) -> str:
    if case.tool == "npufuse":
        return " ".join(["npufuse", "optimize", src.name, "-o", "OUT", "-q",
                         *[a.replace("{out}", "OUT") for a in case.npufuse_args], *extra])
    if case.tool == "ort":
        return (f"optimize_model('{src.name}', model_type='bert', num_heads=12, hidden_size=768, opt_level=0, "
                "use_gpu=False).save_model_to_file(OUT)")
    if case.tool == "onnx":
        return f"onnx.save(onnx.shape_inference.infer_shapes(onnx.load('{src.name}', load_external_data=False)), OUT)"
    return f"onnx_ir.save(optimize_for_ort(onnx_ir.load('{src.name}'))[0], OUT)"


# ----------------------------------------------------------------------------- measuring
def _status_kib(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "RssAnon:", "RssFile:", "RssShmem:")):
                k, v = line.split(":", 1)
                out[k] = int(v.split()[0])
    return out


def _tree(pid: int) -> list[int]:
    try:
        import psutil
    except ImportError:          # the root process only
        return [pid]
    try:
        return [pid] + [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return [pid]


# A lean launcher between this (large) process and the measured one. Linux keeps a process's ru_maxrss across
# exec, and a fork starts with its parent's resident set: a child forked straight from here would report this
# process's own peak (the BERT runs once read 914 MiB, this harness's size, while their own peak was 342 MiB).
# The launcher is forked from here, but the measured process is forked from the launcher (a few MiB); it
# reports the measured process's wait4 ru_maxrss on its last stdout line.
_LAUNCHER = """
import os, subprocess, sys
p = subprocess.Popen(sys.argv[1:])
_, status, ru = os.wait4(p.pid, 0)
print("@@LAUNCHER %d" % (ru.ru_maxrss * 1024), flush=True)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def measure(cmd: list[str], poll_s: float, kill_above: int, log_dir: Path, cwd: Path, env: dict) -> dict:
    """Run cmd in a fresh process (own session, started by a lean launcher); wall time, wait4 ru_maxrss and
    polled tree RSS (the launcher itself left out)."""
    cmd = [sys.executable, "-c", _LAUNCHER, *cmd]
    log_dir.mkdir(parents=True, exist_ok=True)
    out_f = open(log_dir / "stdout.txt", "w+")
    err_f = open(log_dir / "stderr.txt", "w+")
    peaks = {"VmRSS": 0, "RssAnon": 0, "RssFile": 0}
    killed = threading.Event()
    done = threading.Event()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=out_f, stderr=err_f, stdin=subprocess.DEVNULL, cwd=cwd,
                            env=env, start_new_session=True)

    def poll() -> None:
        while not done.is_set():
            tot = {"VmRSS": 0, "RssAnon": 0, "RssFile": 0}
            for p in _tree(proc.pid):
                if p == proc.pid:
                    continue   # the launcher
                try:
                    st = _status_kib(p)
                except (OSError, ValueError):
                    continue
                for k in tot:
                    tot[k] += st.get(k, 0) * 1024
            for k in tot:
                peaks[k] = max(peaks[k], tot[k])
            if tot["VmRSS"] > kill_above and not killed.is_set():
                killed.set()
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except OSError:
                    pass
            done.wait(poll_s)

    th = threading.Thread(target=poll, daemon=True)
    th.start()
    _, status, ru = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    done.set()
    th.join()
    proc.returncode = os.waitstatus_to_exitcode(status)   # reaped here: keep Popen from waiting again
    out_f.seek(0)
    err_f.seek(0)
    stdout, stderr = out_f.read(), err_f.read()
    out_f.close()
    err_f.close()
    rec = {"rc": proc.returncode, "wall_s": wall, "ru_maxrss_bytes": ru.ru_maxrss * 1024,
           "poll_rss_bytes": peaks["VmRSS"], "poll_anon_bytes": peaks["RssAnon"],
           "poll_file_bytes": peaks["RssFile"], "killed_above_limit": killed.is_set()}
    rec["peak_rss_bytes"] = max(rec["ru_maxrss_bytes"], rec["poll_rss_bytes"])
    for line in stdout.splitlines():
        if line.startswith("@@LAUNCHER "):
            rec["ru_maxrss_bytes"] = int(line.split()[1])
            rec["peak_rss_bytes"] = max(rec["ru_maxrss_bytes"], rec["poll_rss_bytes"])
        if line.startswith("@@BENCH "):
            rec.update({k: v for k, v in json.loads(line[8:]).items() if k != "rc"})
    if proc.returncode != 0:
        rec["stderr_tail"] = stderr[-2000:]
    return rec


def file_bytes(path: Path) -> int:
    """The model's size with its external data (apparent sizes)."""
    n = path.stat().st_size
    data = path.with_name(path.name + ".data")
    return n + (data.stat().st_size if data.exists() else 0)


def output_summary(out: Path) -> dict:
    import collections

    import onnx

    m = onnx.load(str(out), load_external_data=False)
    c = collections.Counter(n.op_type if n.domain in ("", "ai.onnx") else f"{n.domain}:{n.op_type}"
                            for n in m.graph.node)
    fused = {k: v for k, v in c.items() if ":" in k or k in ("Attention", "MultiHeadAttention",
                                                                   "LayerNormalization", "Gelu", "FastGelu")}
    return {"nodes": len(m.graph.node), "fused_ops": dict(sorted(fused.items()))}


# ----------------------------------------------------------------------------- reporting
def _med(runs: list[dict], key: str):
    vals = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def summarize(case: Case, runs: list[dict], src: Path, cmd_text: str, out_info: dict | None) -> dict:
    ok = [r for r in runs if r["rc"] == 0 and not r["killed_above_limit"]]
    res = {
        "command": cmd_text, "model": str(src.relative_to(ROOT) if src.is_relative_to(ROOT) else src),
        "model_bytes": file_bytes(src), "target": case.target_text(), "runs": runs, "n_ok": len(ok),
        "median_wall_s": _med(runs, "wall_s"), "median_work_s": _med(runs, "work_s"),
        "median_import_s": _med(runs, "import_s"),
        "median_peak_rss_bytes": _med(runs, "peak_rss_bytes"),
        "max_peak_rss_bytes": max(r["peak_rss_bytes"] for r in runs),
        "median_anon_bytes": _med(runs, "poll_anon_bytes"),
        "min_wall_s": min(r["wall_s"] for r in runs), "max_wall_s": max(r["wall_s"] for r in runs),
        "output": out_info,
    }
    met = len(ok) == len(runs)
    if case.max_rss is not None:
        met = met and res["median_peak_rss_bytes"] < case.max_rss
    if case.max_wall is not None:
        met = met and res["median_wall_s"] < case.max_wall
    res["met"] = met if (case.max_rss or case.max_wall) else None
    res["peak_rss_per_file_size"] = res["median_peak_rss_bytes"] / res["model_bytes"]
    return res


def _fmt_bytes(n) -> str:
    if n is None:
        return "-"
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.0f} MiB"


def _fmt_s(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def print_table(results: dict) -> None:
    hdr = (f"{'case':24s} {'wall s':>8s} {'work s':>8s} {'peak RSS':>10s} {'anon':>10s} {'RSS/file':>8s} "
           f"{'ok':>4s}  target -> met")
    print()
    print(hdr)
    print("-" * len(hdr))
    for name, r in results.items():
        met = {None: "(" + r["target"] + ")", True: "MET", False: "NOT MET"}[r["met"]]
        print(f"{name:24s} {_fmt_s(r['median_wall_s']):>8s} {_fmt_s(r['median_work_s']):>8s} "
              f"{_fmt_bytes(r['median_peak_rss_bytes']):>10s} {_fmt_bytes(r['median_anon_bytes']):>10s} "
              f"{r['peak_rss_per_file_size']:8.2f} {r['n_ok']:>2d}/{len(r['runs'])}  "
              + (f"{r['target']} -> {met}" if r["met"] is not None else met))
        if r["n_ok"] < len(r["runs"]):
            bad = next(x for x in r["runs"] if x["rc"] != 0 or x["killed_above_limit"])
            why = "killed above --kill-above" if bad["killed_above_limit"] else f"exit {bad['rc']}"
            tail = (bad.get("stderr_tail") or "").strip().splitlines()[-3:]
            print(f"{'':24s} a run failed: {why}: {' | '.join(tail)}")


def bert_ratios(results: dict) -> dict | None:
    names = ("bert-npufuse-noverify", "bert-ort", "bert-onnxscript")
    if not all(n in results for n in names):
        return None
    nv = results["bert-npufuse-noverify"]
    peers = {n: results[n] for n in ("bert-ort", "bert-onnxscript") if results[n]["n_ok"]}
    if not peers or not nv["n_ok"]:
        return None
    fastest = min(peers, key=lambda n: peers[n]["median_wall_s"])
    fastest_work = min(peers, key=lambda n: peers[n]["median_work_s"] or float("inf"))
    out = {
        "faster_peer_wall": fastest,
        "npufuse_noverify_wall_over_faster_peer": nv["median_wall_s"] / peers[fastest]["median_wall_s"],
        "faster_peer_work": fastest_work,
        "npufuse_noverify_work_over_faster_peer": (nv["median_work_s"] / peers[fastest_work]["median_work_s"]
                                                   if nv["median_work_s"] and peers[fastest_work]["median_work_s"]
                                                   else None),
        "peak_rss_per_file_size": {n: results[n]["peak_rss_per_file_size"] for n in results
                                   if n.startswith("bert-")},
    }
    print(f"\nBERT-base ({_fmt_bytes(nv['model_bytes'])}): npufuse --no-verify wall / faster peer ({fastest}) = "
          f"{out['npufuse_noverify_wall_over_faster_peer']:.2f}x", end="")
    if out["npufuse_noverify_work_over_faster_peer"] is not None:
        print(f"; work (load+optimize+save, imports excluded) / faster peer ({fastest_work}) = "
              f"{out['npufuse_noverify_work_over_faster_peer']:.2f}x", end="")
    print()
    print("peak RSS / file size: " + ", ".join(f"{n} {v:.2f}" for n, v in out["peak_rss_per_file_size"].items()))
    for n in results:
        if n.startswith("bert-") and results[n].get("output"):
            print(f"  {n:24s} output: {results[n]['output']['nodes']} nodes, fused {results[n]['output']['fused_ops']}")
    return out


def onnx_reference_ratio(results: dict) -> dict | None:
    """npufuse's 100k time over onnx's own load + shape inference + save of the same graph, measured in this run
    (medians, wall and work); a case with `max_ratio` meets its target only under that multiple. None where this
    run did not measure both."""
    cases = {c.name: c for c in CASES}
    ref = results.get(REFERENCE_CASE)
    out = None
    for name, r in results.items():
        ratio_target = cases[name].max_ratio if name in cases else None
        if ratio_target is None:
            continue
        if ref is None or not ref["n_ok"] or not r["n_ok"]:
            print(f"\n{name}: its target {ratio_target:g}x {REFERENCE_CASE} is not judged: run both cases together "
                  f"(--case {name} --case {REFERENCE_CASE})")
            continue
        wall = r["median_wall_s"] / ref["median_wall_s"]
        work = (r["median_work_s"] / ref["median_work_s"]) if r["median_work_s"] and ref["median_work_s"] else None
        r["met"] = bool(r["met"]) and wall < ratio_target
        out = {"case": name, "reference": REFERENCE_CASE, "target_ratio": ratio_target,
               "wall_ratio": wall, "work_ratio": work, "met": wall < ratio_target,
               "median_wall_s": {name: r["median_wall_s"], REFERENCE_CASE: ref["median_wall_s"]},
               "median_work_s": {name: r["median_work_s"], REFERENCE_CASE: ref["median_work_s"]}}
        print(f"\n{name} / {REFERENCE_CASE} (onnx load + infer_shapes + save of the same graph): wall "
              f"{r['median_wall_s']:.2f} / {ref['median_wall_s']:.2f} s = {wall:.2f}x"
              + (f"; work {r['median_work_s']:.2f} / {ref['median_work_s']:.2f} s = {work:.2f}x" if work else "")
              + f"  (target < {ratio_target:g}x: {'MET' if wall < ratio_target else 'NOT MET'})")
    return out


def _versions() -> dict:
    from importlib import metadata

    out = {"python": platform.python_version()}
    for p in ("npufuse", "onnx", "onnxruntime", "onnxscript", "onnx-ir", "numpy", "torch", "transformers"):
        try:
            out[p] = metadata.version(p)
        except metadata.PackageNotFoundError:
            pass
    return out


def _git() -> dict:
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                    capture_output=True, text=True).stdout.strip())
        return {"rev": rev, "dirty": dirty}
    except OSError:
        return {}


def _machine() -> dict:
    mem = None
    try:
        with open("/proc/meminfo") as f:
            mem = int(f.readline().split()[1]) * 1024
    except OSError:
        pass
    return {"platform": platform.platform(), "cpus": os.cpu_count(), "mem_bytes": mem,
            "cpu": next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")),
                        platform.processor()) if os.path.exists("/proc/cpuinfo") else platform.processor()}


def _parse_size(s: str) -> int:
    units = {"": 1, "b": 1, "k": 2**10, "kib": 2**10, "m": MiB, "mib": MiB, "g": GiB, "gib": GiB}
    s = s.strip().lower()
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    return int(float(num) * units[s[len(num):]])


# ----------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", action="append", metavar="NAME|PATTERN",
                    help=f"cases to run (repeatable, shell patterns): {', '.join(c.name for c in CASES)}")
    ap.add_argument("--runs", type=int, default=3, help="runs per case (default 3); medians are reported")
    ap.add_argument("--json", type=Path, default=RESULTS, help=f"results file (default {RESULTS.relative_to(ROOT)})")
    ap.add_argument("--no-json", action="store_true", help="print only")
    ap.add_argument("--cache", type=Path, default=CACHE, help="where generated models live")
    ap.add_argument("--npufuse-arg", action="append", default=[], metavar="ARG",
                    help="extra argument for every npufuse command (repeatable), e.g. --npufuse-arg=--verify-memory=1GiB")
    ap.add_argument("--npufuse-src", type=Path, default=ROOT,
                    help="import npufuse from this source tree (default: this checkout; put first on PYTHONPATH)")
    ap.add_argument("--poll-ms", type=float, default=20.0, help="RSS polling interval (default 20 ms)")
    ap.add_argument("--kill-above", default="10GiB", help="kill a run whose tree RSS passes this (default 10GiB)")
    ap.add_argument("--keep-logs", action="store_true", help="keep each run's stdout/stderr under the cache")
    ap.add_argument("--_build-bert", dest="build_bert", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.build_bert:
        build_bert(args.build_bert)
        return 0
    if args.runs < 1:
        ap.error("--runs must be >= 1")
    pats = args.case or ["*"]
    cases = [c for c in CASES if any(fnmatch.fnmatchcase(c.name, p) for p in pats)]
    unknown = [p for p in pats if not any(fnmatch.fnmatchcase(c.name, p) for c in CASES)]
    if unknown or not cases:
        ap.error(f"unknown case(s) {unknown}; known: {', '.join(c.name for c in CASES)}")
    kill_above = _parse_size(args.kill_above)
    args.cache.mkdir(parents=True, exist_ok=True)

    models: dict[str, Path] = {}
    for c in cases:
        if c.model not in models:
            models[c.model] = ensure_bert(args.cache) if c.model == "bert" else ensure_llama(c.model, args.cache)
    # read the small (embedded-weight) models once so that no run pays for a cold page cache; the sparse
    # data files are not read (their holes would fill the page cache with GiBs of zeros)
    for key, p in models.items():
        if key == "bert":
            with open(p, "rb") as f:
                while f.read(64 * MiB):
                    pass

    print(f"bench_scale: {len(cases)} case(s) x {args.runs} run(s); python {platform.python_version()}, "
          f"{os.cpu_count()} cpus", flush=True)
    for c in cases:
        print(f"  {c.name:24s} {shown_command(c, models[c.model], args.npufuse_arg)}   [target: {c.target_text()}]")
    runs: dict[str, list[dict]] = {c.name: [] for c in cases}
    outputs: dict[str, dict | None] = {c.name: None for c in cases}
    work = Path(tempfile.mkdtemp(prefix="bench_scale.", dir=args.cache))
    src_dir = args.npufuse_src.resolve()
    if not (src_dir / "npufuse" / "__init__.py").exists():
        ap.error(f"--npufuse-src {src_dir}: no npufuse/ package there")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(src_dir), env.get("PYTHONPATH")]))
    try:
        for i in range(args.runs):
            for c in cases:
                rundir = work / f"{c.name}.{i}"
                rundir.mkdir()
                out = rundir / "out.onnx"
                rec = measure(command(c, models[c.model], out, args.npufuse_arg), args.poll_ms / 1000,
                              kill_above, rundir / "logs", rundir, env)
                runs[c.name].append(rec)
                print(f"  run {i + 1}/{args.runs} {c.name:24s} rc={rec['rc']} wall {rec['wall_s']:.2f} s "
                      f"(work {_fmt_s(rec.get('work_s'))} s) peak RSS {_fmt_bytes(rec['peak_rss_bytes'])} "
                      f"(wait4 {_fmt_bytes(rec['ru_maxrss_bytes'])}, polled tree {_fmt_bytes(rec['poll_rss_bytes'])},"
                      f" anon {_fmt_bytes(rec['poll_anon_bytes'])})"
                      + ("  KILLED above --kill-above" if rec["killed_above_limit"] else ""), flush=True)
                if rec["rc"] == 0 and outputs[c.name] is None and out.exists():
                    try:
                        outputs[c.name] = output_summary(out)
                    except Exception as e:   # noqa: BLE001 - a summary is a nicety
                        outputs[c.name] = {"error": repr(e)}
                if args.keep_logs:
                    shutil.copytree(rundir / "logs", args.cache / "logs" / f"{c.name}.{i}", dirs_exist_ok=True)
                shutil.rmtree(rundir, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    results = {c.name: summarize(c, runs[c.name], models[c.model],
                                 shown_command(c, models[c.model], args.npufuse_arg), outputs[c.name])
               for c in cases}
    reference = onnx_reference_ratio(results)   # before the table: it decides the ratio targets
    print_table(results)
    ratios = bert_ratios(results)

    if not args.no_json:
        stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        doc = {}
        if args.json.exists():
            try:
                doc = json.loads(args.json.read_text())
            except ValueError:
                doc = {}
        meta = {"when": stamp, "git": _git(), "versions": _versions(), "machine": _machine(), "runs": args.runs,
                "npufuse_args": args.npufuse_arg, "npufuse_src": str(src_dir), "poll_ms": args.poll_ms,
                "reproduce": "python benchmarks/bench_scale.py " + " ".join(sys.argv[1:] if argv is None else argv)}
        doc.setdefault("cases", {})
        for name, r in results.items():
            doc["cases"][name] = {**r, "meta": meta}
        if ratios is not None:
            doc["bert_ratios"] = {**ratios, "meta": meta}
        if reference is not None:
            doc["onnx_reference_ratio"] = {**reference, "meta": meta}
        doc["method"] = ("wall_s: spawn to reap of a fresh subprocess (imports included); work_s: load+optimize+save "
                         "inside it; peak RSS: max(os.wait4 ru_maxrss, polled VmRSS sum over the process tree); "
                         "medians over runs")
        args.json.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.json.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(doc, indent=2) + "\n")
        os.replace(tmp, args.json)
        print(f"\nwrote {args.json}")
    failed_targets = [n for n, r in results.items() if r["met"] is False]
    return 1 if failed_targets else 0


if __name__ == "__main__":
    sys.exit(main())
