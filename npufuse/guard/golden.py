"""The golden file: seeded inputs and the outputs a model gave on them, in one compressed .npz.

Layout (docs/check.md is the reference):
    input/<encoded name>   one array per graph input
    output/<encoded name>  one array per graph output
    meta                   a 0-d unicode array holding JSON (format, versions, seed, model, graph sha256)
A value name is encoded as its UTF-8 bytes percent-encoded, every byte but A-Z a-z 0-9 _ . - ~
written %XX (urllib.parse.quote with safe=""), so any ONNX name makes a valid, unambiguous npz key.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

import numpy as np
import onnx

from npufuse import __version__
from npufuse.errors import InputError
from npufuse.ir.modelio import atomic_write
from npufuse.console.units import format_bytes

FORMAT = "npufuse.golden"
FORMAT_VERSION = 1


@dataclass
class Golden:
    inputs: dict[str, np.ndarray]
    outputs: dict[str, np.ndarray]
    meta: dict[str, Any] = field(default_factory=dict)


def encode_name(name: str) -> str:
    """An npz-safe key part for a value name (percent-encoded UTF-8)."""
    return quote(name, safe="")


def decode_name(key: str) -> str:
    return unquote(key)


def graph_sha256(model: onnx.ModelProto) -> str:
    """sha256 of the model's serialized GraphProto (deterministic serialization; external weights as
    their references)."""
    return hashlib.sha256(model.graph.SerializeToString(deterministic=True)).hexdigest()


def runtime_versions() -> dict[str, str]:
    import onnxruntime

    return {"npufuse": __version__, "onnxruntime": onnxruntime.__version__, "onnx": onnx.__version__,
            "numpy": np.__version__}


def write_golden(path: str | os.PathLike, golden: Golden) -> Path:
    """Write `golden` atomically (temp file + rename) as a compressed .npz."""
    out = Path(path)
    parent = out.resolve().parent
    if not parent.is_dir():
        raise InputError(f"{out}: folder {parent} does not exist; create it or choose another --save-golden path")
    if out.is_dir():
        raise InputError(f"{out}: is a directory; pass a file path for the golden file")
    arrays: dict[str, np.ndarray] = {}
    bf16_keys = []
    for role, values in (("input", golden.inputs), ("output", golden.outputs)):
        for name, arr in values.items():
            key, arr = f"{role}/{encode_name(name)}", np.asarray(arr)
            if arr.dtype.name == "bfloat16":   # npz has no bf16: its bit patterns as uint16, restored on reading
                arr = arr.view(np.uint16)
                bf16_keys.append(key)
            arrays[key] = arr
    meta = dict(golden.meta, format=FORMAT, format_version=FORMAT_VERSION,
                inputs=list(golden.inputs), outputs=list(golden.outputs))
    if bf16_keys:
        meta["bfloat16"] = bf16_keys
    arrays["meta"] = np.array(json.dumps(meta, sort_keys=True))
    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            np.savez_compressed(f, **arrays)

    atomic_write(out, write, "the golden file")
    return out


def read_golden(path: str | os.PathLike) -> Golden:
    """Read a golden file; InputError (one line) when it is missing or not one npufuse wrote."""
    p = Path(path)
    if p.exists() and not p.is_file():
        raise InputError(f"{p}: not a regular file (a folder, pipe or device); pass the golden .npz file")
    if not p.is_file():
        raise InputError(f"{p}: no such golden file; create one with `npufuse check MODEL --save-golden {p}`")
    _check_declared_sizes(p)
    try:
        with np.load(p, allow_pickle=False) as npz:
            data = {k: npz[k] for k in npz.files}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError, MemoryError) as exc:
        raise InputError(f"{p}: not a readable golden .npz ({type(exc).__name__}); re-create it with "
                         "--save-golden") from None
    if "meta" not in data:
        raise InputError(f"{p}: no 'meta' entry, so not an npufuse golden file; re-create it with --save-golden")
    try:
        meta = json.loads(str(data.pop("meta")))
    except (json.JSONDecodeError, TypeError):
        raise InputError(f"{p}: its 'meta' entry is not JSON; re-create it with --save-golden") from None
    fmt = meta.get("format") if isinstance(meta, dict) else None
    if fmt != FORMAT:
        raise InputError(f"{p}: not an npufuse golden file (format {fmt!r}); re-create it with --save-golden")
    if not isinstance(meta.get("format_version", 0), int):
        raise InputError(f"{p}: its format_version is not a number; re-create it with --save-golden")
    if meta.get("format_version", 0) > FORMAT_VERSION:
        raise InputError(f"{p}: golden format version {meta.get('format_version')} is newer than this npufuse "
                         f"reads ({FORMAT_VERSION}); upgrade npufuse or re-create the file")
    inputs: dict[str, np.ndarray] = {}
    outputs: dict[str, np.ndarray] = {}
    bf16_keys = meta.get("bfloat16") or []
    for key, arr in data.items():
        if key in bf16_keys and arr.dtype == np.uint16:
            arr = arr.view(onnx.helper.tensor_dtype_to_np_dtype(onnx.TensorProto.BFLOAT16))
        role, sep, enc = key.partition("/")
        if not sep or role not in ("input", "output"):
            raise InputError(f"{p}: unexpected entry {key!r}; a golden file holds input/*, output/* and meta")
        (inputs if role == "input" else outputs)[decode_name(enc)] = arr
    # Keep the order the model had when the file was written.
    inputs = {n: inputs[n] for n in meta.get("inputs", []) if n in inputs} | inputs
    outputs = {n: outputs[n] for n in meta.get("outputs", []) if n in outputs} | outputs
    if not outputs:
        raise InputError(f"{p}: the golden file holds no outputs; re-create it with --save-golden")
    return Golden(inputs, outputs, meta)


def _check_declared_sizes(p: Path) -> None:
    """Read each array's .npy header (a few bytes) and refuse a file whose arrays together declare more than
    the memory available, before numpy allocates them: a crafted or corrupt header may declare terabytes."""
    from npufuse.verify.memory_fit import available_memory_bytes

    total = 0
    try:
        with zipfile.ZipFile(p) as zf:
            for info in zf.infolist():
                if not info.filename.endswith(".npy"):
                    continue
                with zf.open(info) as f:
                    version = np.lib.format.read_magic(f)
                    if version == (1, 0):
                        shape, _, dtype = np.lib.format.read_array_header_1_0(f)
                    else:
                        shape, _, dtype = np.lib.format.read_array_header_2_0(f)
                total += math.prod(shape) * max(dtype.itemsize, 1)
                available = available_memory_bytes()
                if total > available:
                    raise InputError(f"{p}: entry {info.filename!r} declares shape {tuple(shape)} {dtype}; the "
                                     f"arrays need {format_bytes(total)}, more than the {format_bytes(available)} "
                                     "of memory available (a corrupt or foreign file?); re-create it with "
                                     "--save-golden")
    except InputError:
        raise
    except (OSError, ValueError, zipfile.BadZipFile, EOFError, RuntimeError) as exc:
        raise InputError(f"{p}: not a readable golden .npz ({type(exc).__name__}); re-create it with "
                         "--save-golden") from None
