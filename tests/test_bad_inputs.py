"""The bad-input table: every hostile input the CLI has met, run as a user runs it (a subprocess).

Each case must end in exactly one stderr line `npufuse: error: ...` with the expected exit code, no traceback,
no control character reaching the terminal, every byte of the input (model and data files) unchanged, and no
stray file in the input's or the output's folder. The cases run concurrently (a thread per subprocess) so the
table stays fast; each test then judges its own case.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
import zipfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from io import BytesIO
from pathlib import Path

import numpy as np
import onnx
import pytest
from builders import conv_chain
from onnx import TensorProto, helper

REPO = Path(__file__).resolve().parent.parent
ESC_NAME = "x\x1b]0;pwned\x07\x1b[2J\x9b1m"  # retitles the window, clears the screen, a C1 CSI


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def npufuse(*args: str | Path, hook: str = "", cwd: Path | None = None) -> subprocess.CompletedProcess:
    """The CLI in a fresh interpreter; `hook` is Python run before it (to simulate a kill or Ctrl-C mid-run)."""
    code = f"{hook}\nfrom npufuse.cli import main\nmain()"
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                          timeout=120, env=_env(), cwd=cwd)


# ---- models -------------------------------------------------------------------------------------------------

def relu_model(shape: list, x: str = "x", node: str = "r", y: str = "y", feed: str | None = None) -> onnx.ModelProto:
    """Relu(x) -> y; `feed` names what the Relu reads instead of x (a dangling input makes it invalid)."""
    g = helper.make_graph([helper.make_node("Relu", [feed or x], [y], name=node)], "g",
                          [helper.make_tensor_value_info(x, TensorProto.FLOAT, shape)],
                          [helper.make_tensor_value_info(y, TensorProto.FLOAT, shape)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def save(model: onnx.ModelProto, path: Path) -> Path:
    onnx.save(model, path)
    return path


def save_external(folder: Path, name: str = "m.onnx", data: str = "m.data") -> Path:
    """conv_chain with its weights in `data` beside it."""
    onnx.save(conv_chain(act="Relu", cin=16, cout=32), folder / name, save_as_external_data=True,
              all_tensors_to_one_file=True, location=data, size_threshold=0)
    return folder / name


def non_utf8(folder: Path, where: str) -> Path:
    """A model whose node name ('node') or value name ('value') holds bytes that are not UTF-8."""
    raw = relu_model([2, 4], x="xin", node="NODE").SerializeToString()
    raw = raw.replace(b"NODE", b"N\xff\xfeE") if where == "node" else raw.replace(b"xin", b"x\xffn")
    p = folder / f"bad_{where}.onnx"
    p.write_bytes(raw)
    return p


def non_utf8_graph_name(folder: Path) -> Path:
    """A model whose graph name holds bytes that are not UTF-8 (report priced it and crashed on it)."""
    m = relu_model([2, 4])
    m.graph.name = "GRAPHNAME"
    p = folder / "bad_graph.onnx"
    p.write_bytes(m.SerializeToString().replace(b"GRAPHNAME", b"GRAPH\xffAME"))
    return p


def _fifo_output(i: Path, o: Path, *command: str) -> list:
    os.mkfifo(o / "pipe.out")
    model = _conv(i)
    return {"optimize": ["optimize", model, "-o", o / "pipe.out"],
            "report": ["report", model, "-o", o / "pipe.out"],
            "junit": ["check", model, model, "--junit", o / "pipe.out"]}[command[0]]


def _target_copy(i: Path) -> Path:
    from importlib import resources

    p = i / "my_npu.toml"
    p.write_bytes(resources.files("npufuse.npu_model").joinpath("profiles", "Ascend310P3.toml").read_bytes())
    return p


def write_guard_hook(folder: Path) -> str:
    """Python run before the CLI that ends it with 99 on any attempt to create, open for writing, rename, remove,
    link or chmod a file in `folder` (an audit hook: chmod alone does not stop root, as CI may run)."""
    return (f"import os, sys\n_SRC = {str(folder.resolve())!r}\n"
            "def _inside(p):\n"
            "    try:\n        return os.path.realpath(os.fsdecode(p)).startswith(_SRC + os.sep)\n"
            "    except (TypeError, ValueError):\n        return False\n"
            "def _audit(event, args):\n"
            "    bad = False\n"
            "    if event == 'open' and len(args) >= 3 and not isinstance(args[0], int):\n"
            "        mode, flags = args[1], args[2] or 0\n"
            "        bad = _inside(args[0]) and ((isinstance(mode, str) and any(c in mode for c in 'wax+')) or "
            "bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)))\n"
            "    elif event in ('os.rename', 'os.remove', 'os.mkdir', 'os.link', 'os.symlink', 'os.truncate', "
            "'shutil.copyfile', 'os.chmod'):\n"
            "        bad = any(_inside(a) for a in args[:2] if isinstance(a, (str, bytes, os.PathLike)))\n"
            "    if bad:\n"
            "        os.write(2, f'write inside the input folder: {event} {args[:2]}\\n'.encode())\n"
            "        os._exit(99)\n"
            "sys.addaudithook(_audit)\n")


def nan_model(folder: Path) -> Path:
    """y = (x - x) / 0: NaN on every input, so a golden of it would check nothing."""
    g = helper.make_graph([helper.make_node("Sub", ["x", "x"], ["d"]), helper.make_node("Div", ["d", "zero"], ["y"])],
                          "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
                          [helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0])])
    return save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=10), folder / "nan.onnx")


def golden_declaring(folder: Path, elements: int) -> Path:
    """An .npz whose one array's header declares `elements` float32 values and holds almost none of them."""
    header = BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False, "shape": (elements,)})
    p = folder / "g.npz"
    with zipfile.ZipFile(p, "w") as z:
        z.writestr("output/y.npy", header.getvalue() + b"\0" * 64)
    return p


# ---- the table ----------------------------------------------------------------------------------------------

@dataclass
class Case:
    id: str
    build: Callable[[Path, Path], list]   # (input folder, output folder) -> CLI arguments
    needles: tuple[str, ...]              # each must be in the error line
    code: int = 2


def _fifo(i: Path, o: Path) -> list:
    os.mkfifo(i / "pipe.onnx")
    return ["optimize", i / "pipe.onnx", "-o", o / "o.onnx"]


def _fifo_golden(i: Path, o: Path) -> list:
    os.mkfifo(i / "g.npz")
    return ["check", save(conv_chain(), i / "m.onnx"), "--golden", i / "g.npz"]


def _symlink_to_data(i: Path, o: Path) -> list:
    m = save_external(i)
    (o / "link.data").symlink_to(i / "m.data")
    return ["optimize", m, "-o", o / "link.data"]


def _hardlink_to_data(i: Path, o: Path) -> list:
    m = save_external(i)
    os.link(i / "m.data", o / "hard.data")
    return ["optimize", m, "-o", o / "hard.data"]


def _hardlink_to_model(i: Path, o: Path) -> list:
    m = save(conv_chain(), i / "m.onnx")
    os.link(m, o / "same.onnx")
    return ["optimize", m, "-o", o / "same.onnx"]


def _check_pair(i: Path, o: Path, *extra) -> list:
    m = save_external(i)
    opt = save_external(o, "opt.onnx", "opt.data")
    return ["check", m, opt, *extra]


def _different_outputs(i: Path, o: Path) -> list:
    return ["check", save(relu_model([2, 4], y="y"), i / "a.onnx"), save(relu_model([2, 4], y="z"), i / "b.onnx")]


def _conv(i: Path) -> Path:
    return save(conv_chain(), i / "m.onnx")


CASES = [
    # -- met before (tests/test_cli.py, tests/test_guard.py) --
    Case("missing-file", lambda i, o: ["optimize", i / "nope.onnx"], ("nope.onnx", "no such file")),
    Case("not-onnx", lambda i, o: ["optimize", (i / "n.onnx").write_text("not a model\n" * 50) and i / "n.onnx"],
         ("n.onnx", "not a readable ONNX model")),
    Case("truncated", lambda i, o: ["optimize", (i / "t.onnx").write_bytes(conv_chain().SerializeToString()[:200])
                                    and i / "t.onnx", "-o", o / "o.onnx"], ("t.onnx",)),
    Case("invalid-graph", lambda i, o: ["optimize", save(relu_model([2], feed="missing"), i / "g.onnx")],
         ("g.onnx", "invalid ONNX graph")),
    Case("unknown-pattern", lambda i, o: ["optimize", _conv(i), "--only", "nonesuch"], ("unknown pattern",)),
    Case("output-folder-missing", lambda i, o: ["optimize", _conv(i), "-o", o / "no" / "o.onnx"], ("does not exist",)),
    Case("output-is-a-directory", lambda i, o: ["optimize", _conv(i), "-o", o], ("directory",)),
    Case("output-is-the-input", lambda i, o: ["optimize", _conv(i), "-o", i / "m.onnx"], ("overwrite the input",)),
    Case("dim-without-value", lambda i, o: ["optimize", _conv(i), "--dim", "batch"], ("NAME=INT",)),
    Case("dim-zero", lambda i, o: ["optimize", _conv(i), "--dim", "batch=0"], ("INT >= 1",)),
    Case("dim-unknown-name", lambda i, o: ["optimize", _conv(i), "--dim", "sequence=8"], ("no such symbolic dim",)),
    Case("seed-negative", lambda i, o: ["optimize", _conv(i), "--seed", "-1"], ("--seed",)),
    Case("command-typo", lambda i, o: ["optimise", _conv(i)], ("No such command",)),
    Case("report-format", lambda i, o: ["report", _conv(i), "--format", "pdf"], ("--format",)),
    Case("report-equals-output", lambda i, o: ["optimize", _conv(i), "-o", o / "s.onnx", "--report", o / "s.onnx"],
         ("--report",)),
    Case("check-one-model", lambda i, o: ["check", _conv(i)], ("exactly one of",)),
    Case("check-bad-atol", lambda i, o: ["check", _conv(i), i / "m.onnx", "--atol", "Y=1e-3"], ("NAME:NUMBER",)),
    Case("check-no-golden", lambda i, o: ["check", _conv(i), "--golden", i / "none.npz"], ("no such golden file",)),
    # -- item 2: tracebacks --
    Case("negative-input-dim", lambda i, o: ["optimize", save(relu_model([-3, 4]), i / "neg.onnx"), "-o",
                                             o / "o.onnx"], ("input 'x'", "dim -3")),
    Case("negative-input-dim-report", lambda i, o: ["report", save(relu_model([-3, 4]), i / "neg.onnx")],
         ("dim -3",)),
    Case("negative-input-dim-check", lambda i, o: ["check", save(relu_model([-3, 4]), i / "neg.onnx"),
                                                   i / "neg.onnx"], ("dim -3",)),
    Case("huge-fixed-dims", lambda i, o: ["optimize", save(relu_model([100000] * 3), i / "h.onnx"), "-o",
                                          o / "o.onnx"], ("input 'x'", "(100000, 100000, 100000)", "--no-verify")),
    Case("huge-fixed-dims-check", lambda i, o: ["check", save(relu_model([100000] * 3), i / "h.onnx"),
                                                i / "h.onnx"], ("input 'x'", "memory available",
                                                                "machine with more memory")),
    Case("huge-dim-option", lambda i, o: ["optimize", save(relu_model(["N", 4]), i / "s.onnx"), "--dim",
                                          "N=99999999999", "-o", o / "o.onnx"], ("input 'x'", "--dim")),
    Case("huge-dim-option-golden", lambda i, o: ["check", save(relu_model(["N", 4]), i / "s.onnx"), "--dim",
                                                 "N=99999999999", "--save-golden", o / "g.npz"], ("input 'x'",)),
    Case("dim-too-many-digits", lambda i, o: ["optimize", save(relu_model(["N", 4]), i / "s.onnx"), "--dim",
                                              "N=" + "9" * 5000], ("NAME=INT",)),
    Case("dim-unicode-digit", lambda i, o: ["optimize", save(relu_model(["N", 4]), i / "s.onnx"), "--dim", "N=²"],
         ("NAME=INT",)),
    Case("output-in-proc", lambda i, o: ["optimize", _conv(i), "-o", "/proc/x.onnx"], ("/proc/x.onnx",)),
    Case("report-output-in-proc", lambda i, o: ["report", _conv(i), "-o", "/proc/x.txt"], ("/proc/x.txt",)),
    Case("golden-in-proc", lambda i, o: ["check", _conv(i), "--save-golden", "/proc/x.npz"], ("/proc/x.npz",)),
    Case("golden-declares-petabytes", lambda i, o: ["check", _conv(i), "--golden", golden_declaring(i, 10**15)],
         ("output/y.npy", "memory available")),
    Case("check-different-input-shape", lambda i, o: ["check", save(relu_model([2, 4]), i / "a.onnx"),
                                                      save(relu_model([3, 4]), i / "b.onnx")],
         ("input 'x'", "dim 0 = 3", "different models")),
    Case("check-different-input-rank", lambda i, o: ["check", save(relu_model([2, 4]), i / "a.onnx"),
                                                     save(relu_model([2, 4, 1]), i / "b.onnx")],
         ("input 'x'", "rank 3", "different models")),
    Case("golden-of-nan-outputs", lambda i, o: ["check", nan_model(i), "--save-golden", o / "g.npz"],
         ("output 'y'", "NaN/inf everywhere", "would check nothing")),
    Case("golden-declares-6GB", lambda i, o: ["check", _conv(i), "--golden", golden_declaring(i, 1_500_000_000)],
         ("g.npz",)),
    Case("non-utf8-node-name", lambda i, o: ["optimize", non_utf8(i, "node"), "-o", o / "o.onnx"],
         ("node #0", "UTF-8")),
    Case("non-utf8-value-name-report", lambda i, o: ["report", non_utf8(i, "value")], ("input #0", "UTF-8")),
    Case("non-utf8-value-name-check", lambda i, o: ["check", non_utf8(i, "value"), non_utf8(i, "value")],
         ("UTF-8",)),
    Case("fifo-model", _fifo, ("pipe.onnx", "not a regular file")),
    Case("fifo-golden", _fifo_golden, ("g.npz", "not a regular file")),
    # -- item 3: an output naming a file the input reads --
    Case("output-is-input-data", lambda i, o: ["optimize", save_external(i), "-o", i / "m.data"],
         ("external data file",)),
    Case("output-data-is-input-data", lambda i, o: ["optimize", save_external(i, data="m.onnx.data"), "-o",
                                                    i / "m.onnx", "--overwrite"], ("external data file",)),
    Case("report-option-is-input-data", lambda i, o: ["optimize", save_external(i), "-o", o / "o.onnx", "--report",
                                                      i / "m.data"], ("--report", "external data file")),
    Case("report-is-output-data", lambda i, o: ["optimize", save_external(i), "-o", o / "o.onnx", "--report",
                                                o / "o.onnx.data"], ("--report",)),
    Case("report-cmd-output-is-input-data", lambda i, o: ["report", save_external(i), "-o", i / "m.data"],
         ("-o", "external data file")),
    Case("junit-is-original-data", lambda i, o: _check_pair(i, o, "--junit", i / "m.data"),
         ("--junit", "external data file")),
    Case("junit-is-optimized-data", lambda i, o: _check_pair(i, o, "--junit", o / "opt.data"), ("--junit",)),
    Case("json-is-original-data", lambda i, o: _check_pair(i, o, "--json", i / "m.data"), ("--json",)),
    Case("save-golden-is-input-data", lambda i, o: ["check", save_external(i), "--save-golden", i / "m.data"],
         ("--save-golden", "external data file")),
    Case("save-golden-is-input", lambda i, o: ["check", _conv(i), "--save-golden", i / "m.onnx"],
         ("--save-golden", "overwrite the input")),
    Case("output-symlink-to-input-data", _symlink_to_data, ("external data file",)),
    Case("output-hardlink-to-input-data", _hardlink_to_data, ("external data file",)),
    Case("output-hardlink-to-input", _hardlink_to_model, ("overwrite the input",)),
    Case("output-is-a-fifo", lambda i, o: _fifo_output(i, o, "optimize"), ("pipe.out", "device, FIFO or socket")),
    Case("report-output-is-a-fifo", lambda i, o: _fifo_output(i, o, "report"), ("device, FIFO or socket",)),
    Case("junit-is-a-fifo", lambda i, o: _fifo_output(i, o, "junit"), ("--junit", "device, FIFO or socket")),
    Case("output-is-the-target-profile", lambda i, o: ["optimize", _conv(i), "--target", _target_copy(i), "-o",
                                                       i / "my_npu.toml"], ("-o", "already reads or writes")),
    Case("report-is-the-target-profile", lambda i, o: ["report", _conv(i), "--target", _target_copy(i), "-o",
                                                       i / "my_npu.toml"], ("-o", "already reads or writes")),
    Case("non-utf8-graph-name-report", lambda i, o: ["report", non_utf8_graph_name(i)], ("graph's name", "UTF-8")),
    Case("line-break-in-output-name", lambda i, o: ["check", _conv(i), save(relu_model([2, 4], y="y\nPASS: ok"),
                                                                           i / "nl.onnx")], ("line break",)),
    # -- item 5: usage, not drift --
    Case("check-different-outputs", _different_outputs, ("has no output 'y'", "'z'")),
    # -- item 6: names with control characters, in an error line --
    Case("control-characters-in-path", lambda i, o: ["optimize", i / f"{ESC_NAME}.onnx"],
         ("\\x1b]0;pwned\\x07\\x1b[2J\\x9b1m.onnx", "no such file")),
    Case("control-characters-in-names", lambda i, o: ["check", _conv(i), save(relu_model([2, 4], x=ESC_NAME),
                                                                                i / "e.onnx")], ("\\x1b]0;pwned",)),
]


def _tree(folder: Path) -> dict[str, str]:
    """Every entry under `folder` (links not followed) -> sha256 of a regular file's bytes, else its kind."""
    out = {}
    for p in sorted(folder.rglob("*")):
        rel = str(p.relative_to(folder))
        if p.is_symlink():
            out[rel] = "link -> " + os.readlink(p)
        elif p.is_file():
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
        else:
            out[rel] = "dir" if p.is_dir() else "special"
    return out


@dataclass
class Outcome:
    result: subprocess.CompletedProcess
    before: tuple[dict, dict]
    after: tuple[dict, dict]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Outcome]:
    prepared = []
    for case in CASES:
        root = tmp_path_factory.mktemp(case.id)
        i, o = root / "in", root / "out"
        i.mkdir()
        o.mkdir()
        args = case.build(i, o)
        prepared.append((case, i, o, args, (_tree(i), _tree(o))))

    def run(item) -> Outcome:
        case, i, o, args, before = item
        r = npufuse(*args, cwd=o)
        return Outcome(r, before, (_tree(i), _tree(o)))

    with ThreadPoolExecutor(max_workers=max(os.cpu_count() or 2, 2)) as pool:
        return {item[0].id: out for item, out in zip(prepared, pool.map(run, prepared))}


def assert_one_error_line(r: subprocess.CompletedProcess, code: int, *needles: str) -> str:
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("npufuse: error: "), lines[0]
    for n in needles:
        assert n in lines[0], lines[0]
    for stream in (r.stdout, r.stderr):
        assert not any(ord(c) < 32 and c not in "\n\t" or 0x7f <= ord(c) <= 0x9f for c in stream), repr(stream)
    return lines[0]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, outcomes: dict[str, Outcome]) -> None:
    got = outcomes[case.id]
    assert_one_error_line(got.result, case.code, *case.needles)
    assert got.after[0] == got.before[0], "the input folder changed"
    assert got.after[1] == got.before[1], "the output folder changed"


# ---- item 4: leftovers ----------------------------------------------------------------------------------------

def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_sigkill_during_the_write_leaves_a_temp_the_next_run_removes(tmp_path: Path) -> None:
    src, out = tmp_path / "in", tmp_path / "out"
    src.mkdir()
    out.mkdir()
    model = _conv(src)
    before = _tree(src)
    hook = ("import os, signal, npufuse.ir.modelio as m\n"
            "m._chmod_like_umask = lambda p: os.kill(os.getpid(), signal.SIGKILL)")
    r = npufuse("optimize", model, "-o", out / "o.onnx", "-q", hook=hook)
    assert r.returncode == -signal.SIGKILL
    left = [p for p in out.iterdir()]
    assert len(left) == 1 and left[0].name.startswith(".o.onnx.") and left[0].name.endswith(".tmp"), left
    # A live writer's temp (this test's pid), a fresh one of a dead writer, and another output's stay.
    dead = _dead_pid()
    keep = [out / f".o.onnx.{os.getpid()}.abcdefgh.tmp", out / f".o.onnx.{dead}.freshone.tmp",
            out / f".other.onnx.{dead}.abcdefgh.tmp"]
    for k in keep:
        k.write_bytes(b"partial")
    old = time.time() - 3600
    os.utime(left[0], (old, old))
    os.utime(keep[0], (old, old))
    os.utime(keep[2], (old, old))
    r = npufuse("optimize", model, "-o", out / "o.onnx", "-q")
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in out.iterdir()) == sorted(["o.onnx"] + [k.name for k in keep])
    onnx.checker.check_model(onnx.load(out / "o.onnx"), full_check=True)
    assert _tree(src) == before


def test_a_stale_temp_folder_of_an_external_data_write_is_removed(tmp_path: Path) -> None:
    src, out = tmp_path / "in", tmp_path / "out"
    src.mkdir()
    out.mkdir()
    model = save_external(src)
    stale = out / f".o.onnx.{_dead_pid()}.abcdefgh.tmp"
    stale.mkdir()
    (stale / "o.onnx.data").write_bytes(b"half")
    old = time.time() - 3600
    os.utime(stale, (old, old))
    r = npufuse("optimize", model, "-o", out / "o.onnx", "-q")
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["o.onnx", "o.onnx.data"]


@pytest.mark.parametrize("where", ["write", "verify"])
def test_ctrl_c_exits_130_with_one_line_and_leaves_nothing(tmp_path: Path, where: str) -> None:
    src, out = tmp_path / "in", tmp_path / "out"
    src.mkdir()
    out.mkdir()
    model = _conv(src) if where == "write" else save_external(src)  # an embedded model goes through atomic_write
    before = _tree(src)
    # A real SIGINT, delivered while the temp file exists (write) or while the original runs (verify).
    target = ("import npufuse.ir.modelio as m; m._chmod_like_umask" if where == "write" else
              "import npufuse.verify.inputs as m; m.value_for")
    # Python leaves SIGINT ignored when it starts ignored (a background job of a non-interactive shell, as CI may
    # run us): restore the handler a terminal's Ctrl-C meets.
    hook = (f"import os, signal\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"
            f"{target.split(';')[0]}\n_orig = {target.split('; ')[1]}\n"
            f"def _interrupt(*a, **k):\n    os.kill(os.getpid(), signal.SIGINT)\n    return _orig(*a, **k)\n"
            f"{target.split('; ')[1]} = _interrupt")
    r = npufuse("optimize", model, "-o", out / "o.onnx", "--report", out / "r.json", hook=hook)
    assert_one_error_line(r, 130, "interrupted")
    assert list(out.iterdir()) == []
    assert _tree(src) == before


def test_verifying_an_external_data_model_writes_nothing_beside_it(tmp_path: Path) -> None:
    """optimize, report and check read the weights in place: the input folder may be read-only."""
    src, out = tmp_path / "in", tmp_path / "out"
    src.mkdir()
    out.mkdir()
    model = save_external(src)
    before = _tree(src)
    # chmod does not stop root (CI may run as root), so an audit hook also fails the run on any attempt to create,
    # open for writing, rename or remove a file in the input's folder.
    audit = write_guard_hook(src)
    os.chmod(src, 0o555)
    try:
        for args in (["optimize", model, "-o", out / "o.onnx", "-q"], ["report", model, "-q"],
                     ["check", model, model, "-q"], ["check", model, "--save-golden", out / "g.npz"]):
            r = npufuse(*args, hook=audit)
            assert r.returncode == 0, (args, r.stderr)
            assert _tree(src) == before, args
    finally:
        os.chmod(src, 0o755)


@pytest.mark.parametrize("write", ["open(P, 'w').close()", "os.open(P, os.O_WRONLY | os.O_CREAT)",
                                   "os.mkdir(P)", "os.rename(Q, P)"])
def test_the_write_guard_hook_does_catch_a_write(tmp_path: Path, write: str) -> None:
    """The hook the read-only test runs under is a real check: a write into the folder it guards ends the run
    with 99, whichever call makes it."""
    src = tmp_path / "in"
    src.mkdir()
    outside = tmp_path / "q.txt"
    outside.write_text("q")
    code = f"import os\nP = {str(src / 'x.txt')!r}\nQ = {str(outside)!r}\n{write}\n"
    r = npufuse("profiles", hook=write_guard_hook(src) + code)
    assert r.returncode == 99, r.stderr
    assert "write inside the input folder" in r.stderr


def test_a_full_stdout_is_one_line_and_exit_2_and_a_closed_pipe_is_quiet(tmp_path: Path) -> None:
    code = "from npufuse.cli import main\nmain()"
    with open("/dev/full", "w") as full:
        r = subprocess.run([sys.executable, "-c", code, "report", _conv(tmp_path)], stdout=full,
                           stderr=subprocess.PIPE, text=True, timeout=120, env=_env())
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("npufuse: error: cannot write to standard output")
    p = subprocess.Popen([sys.executable, "-c", code, "report", _conv(tmp_path)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=_env())
    p.stdout.close()   # the reader leaves before npufuse prints (it is still starting up), as `| head` does
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 0 and err == ""


# ---- item 6: control characters in outputs that succeed -------------------------------------------------------

def _has_control(text: str) -> bool:
    return any(ord(c) < 32 and c not in "\n\t" or 0x7f <= ord(c) <= 0x9f for c in text)


def test_names_with_control_characters_are_escaped_in_every_text_output(tmp_path: Path) -> None:
    model = save(relu_model([2, 4], x=ESC_NAME, node="n\x1b[2J", y="y\x1b[31m"), tmp_path / f"{ESC_NAME}.onnx")
    for fmt in ("text", "markdown", "html"):
        r = npufuse("report", model, "--format", fmt, "-o", tmp_path / f"r.{fmt}")
        assert r.returncode == 0, r.stderr
        assert not _has_control(r.stdout + r.stderr)
        written = (tmp_path / f"r.{fmt}").read_text(encoding="utf-8")
        assert not _has_control(written), fmt
        assert "\\x1b]0;pwned\\x07" in written, fmt  # escaped, not dropped
    out = tmp_path / f"{ESC_NAME}.out.onnx"
    r = npufuse("optimize", model, "-o", out)
    assert r.returncode == 0, r.stderr
    assert not _has_control(r.stdout + r.stderr) and "\\x1b]0;pwned" in r.stdout
    r = npufuse("check", model, out, "--junit", tmp_path / "j.xml")
    assert r.returncode == 0, r.stderr
    assert not _has_control(r.stdout + r.stderr) and "y\\x1b[31m" in r.stdout
    suite = ET.parse(tmp_path / "j.xml").getroot()  # well-formed XML despite the names
    assert [c.get("name") for c in suite.iter("testcase")] == ["y\\x1b[31m"]
