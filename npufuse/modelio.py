"""Loading and writing models: clear errors on bad input, atomic writes, weights left on disk."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import onnx
from onnx import external_data_helper

from npufuse.errors import InputError, first_line

# A protobuf cannot exceed 2 GiB; past this size weights go to an external data file.
_PROTOBUF_LIMIT_BYTES = 2**31 - 2**20


def load_model(path: str | os.PathLike) -> onnx.ModelProto:
    """Load a model without pulling external weights into memory; raise InputError on bad input."""
    p = Path(path)
    if not p.exists():
        raise InputError(f"{p}: no such file; pass the path of an .onnx model")
    if p.is_dir():
        raise InputError(f"{p}: is a directory; pass the path of an .onnx model file")
    try:
        model = onnx.load(str(p), load_external_data=False)
    except Exception as exc:  # protobuf raises DecodeError, ValueError, ...
        raise InputError(
            f"{p}: not a readable ONNX model ({type(exc).__name__}: {first_line(exc)}); "
            "check the file is complete and was saved by onnx.save"
        ) from None
    if not model.graph.node and not model.graph.output:
        raise InputError(f"{p}: the file parsed but holds no graph (truncated or not ONNX?); re-export the model")
    try:
        # By path, so that external data is looked up beside the model (and models over 2 GiB work).
        onnx.checker.check_model(str(p))
    except Exception as exc:
        raise InputError(f"{p}: invalid ONNX graph: {first_line(exc)}; fix the exporter output or re-export") from None
    return model


def uses_external_data(model: onnx.ModelProto) -> bool:
    return any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer)


def check_model(model: onnx.ModelProto, base_dir: str | None) -> bytes | None:
    """onnx.checker on `model`; weights kept on disk are checked where they are (beside the source).

    Returns the serialized model when it holds all its weights (the checker needs those bytes anyway, and
    writing them saves serializing a large model twice), else None."""
    if base_dir is None or not uses_external_data(model):
        blob = model.SerializeToString()
        onnx.checker.check_model(blob)
        return blob
    fd, tmp = tempfile.mkstemp(suffix=".onnx", dir=base_dir)
    os.close(fd)
    try:
        with open(tmp, "wb") as f:
            f.write(model.SerializeToString())
        onnx.checker.check_model(tmp)
    finally:
        os.unlink(tmp)
    return None


def model_dir(path: str | os.PathLike) -> str:
    """The folder that external-data locations in the model at `path` are relative to."""
    return str(Path(path).resolve().parent)


def check_output_path(out: str | os.PathLike, source: str | os.PathLike, overwrite_input: bool = False,
                      flag: str = "-o", others: tuple[str | os.PathLike, ...] = ()) -> Path:
    """Refuse an output path that is the input (unless asked), another file of the same run, a folder,
    or in a folder that does not exist or cannot be written. `flag` names the option in the message."""
    out_p = Path(out)
    if out_p.exists() and out_p.resolve() == Path(source).resolve() and not overwrite_input:
        hint = " or pass --overwrite" if flag == "-o" else ""
        raise InputError(f"{out_p}: {flag} would overwrite the input model; choose another path{hint}")
    for other in others:
        if out_p.resolve() == Path(other).resolve():
            raise InputError(f"{out_p}: {flag} names a file this run already reads or writes; choose another path")
    parent = out_p.resolve().parent
    if not parent.is_dir():
        raise InputError(f"{out_p}: {flag} folder {parent} does not exist; create it or choose another path")
    if not os.access(parent, os.W_OK):
        raise InputError(f"{out_p}: {flag} folder {parent} is not writable; choose another path")
    if out_p.is_dir():
        raise InputError(f"{out_p}: {flag} is a directory; pass a file path")
    return out_p


def save_model_atomic(model: onnx.ModelProto, out: str | os.PathLike, source_dir: str | None = None,
                      serialized: bytes | None = None) -> Path:
    """Write `model` to `out` through a temp file and a rename, so a reader never sees half a file.

    Weights still on disk beside the source are loaded first; a model too large for one protobuf is
    written with its weights in `<out>.data` beside it. `serialized`, when given, is `model` already
    serialized (see check_model) and is written as it is.
    """
    out_p = Path(out)
    if serialized is not None:
        atomic_write(out_p, lambda tmp: Path(tmp).write_bytes(serialized), "the output model")
        return out_p
    if source_dir is not None and any(
        external_data_helper.uses_external_data(t) for t in external_data_helper._get_all_tensors(model)
    ):
        external_data_helper.load_external_data_for_model(model, source_dir)
    if _approx_size_bytes(model) <= _PROTOBUF_LIMIT_BYTES:
        atomic_write(out_p, lambda tmp: onnx.save(model, tmp), "the output model")
        return out_p
    # Too big for one protobuf: weights go to <out>.data. Both files are written in a temp folder beside
    # the output and renamed into place, the data first, so no reader sees a half-written pair.
    data_name = out_p.name + ".data"
    with tempfile.TemporaryDirectory(prefix=f".{out_p.name}.", dir=str(out_p.resolve().parent)) as tmp_dir:
        try:
            tmp_model = Path(tmp_dir) / out_p.name
            onnx.save(model, str(tmp_model), save_as_external_data=True, all_tensors_to_one_file=True,
                      location=data_name)
            for f in (tmp_model.with_name(data_name), tmp_model):
                _chmod_like_umask(str(f))
                os.replace(f, out_p.with_name(f.name))
        except OSError as exc:
            raise InputError(f"{out_p}: cannot write the output model ({exc.strerror}); choose another path") from None
    return out_p


def atomic_write(out: str | os.PathLike, write: Callable[[str], None], what: str = "the file") -> Path:
    """Call `write(tmp_path)` on a temp file beside `out`, then rename it over `out`: a reader sees the old
    file or the whole new one, never half of it. InputError (one line) when it cannot be written."""
    out_p = Path(out)
    fd, tmp = tempfile.mkstemp(prefix=f".{out_p.name}.", suffix=".tmp", dir=str(out_p.resolve().parent))
    os.close(fd)
    try:
        write(tmp)
        _chmod_like_umask(tmp)
        os.replace(tmp, out_p)
    except OSError as exc:
        raise InputError(f"{out_p}: cannot write {what} ({exc.strerror}); choose another path") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out_p


def _chmod_like_umask(path: str) -> None:
    """Temp files are created 0600; the file we hand over gets the permissions a plain open() would give."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def _approx_size_bytes(model: onnx.ModelProto) -> int:
    """The serialized size, near enough to decide on external data: the weights dominate, and summing
    their payloads is far cheaper than protobuf's ByteSize() over a large model."""
    weights = sum(len(t.raw_data) or t.ByteSize() for t in model.graph.initializer)
    return weights + sum(n.ByteSize() for n in model.graph.node) + sum(f.ByteSize() for f in model.functions)


