"""Loading and writing models: clear errors on bad input, atomic writes, weights left on disk."""

from __future__ import annotations

import errno
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain
from pathlib import Path

import onnx
from npufuse.errors import InputError, first_line
from npufuse.console.progress import Progress
from npufuse.ir.weights import (
    data_files,
    REFERENCE_THRESHOLD_BYTES,
    external_ref,
    is_external,
    iter_tensors,
    len_field,
    nested_tensors,
    load_skeleton,
    read_array,
    set_external_ref,
    tensor_nbytes,
)

# A protobuf cannot exceed 2 GiB; past this size weights go to an external data file.
_PROTOBUF_LIMIT_BYTES = 2**31 - 2**20


def load_model(path: str | os.PathLike) -> onnx.ModelProto:
    """Load a model's structure without its weights (see `weights.load_skeleton`): every large initializer is a
    reference to its bytes, in an external data file or in the .onnx file itself. Raise InputError on bad input."""
    p = Path(path)
    if not p.exists():
        raise InputError(f"{p}: no such file; pass the path of an .onnx model")
    if p.is_dir():
        raise InputError(f"{p}: is a directory; pass the path of an .onnx model file")
    if not p.is_file():  # a FIFO or a device would block the read forever, or never end
        raise InputError(f"{p}: not a regular file (a pipe, socket or device); save the model to a file first")
    try:
        model = load_skeleton(p)
    except Exception as exc:  # WireFormatError, protobuf's DecodeError, OSError, ...
        raise InputError(
            f"{p}: not a readable ONNX model ({type(exc).__name__}: {first_line(exc)}); "
            "check the file is complete and was saved by onnx.save"
        ) from None
    if not model.graph.node and not model.graph.output:
        raise InputError(f"{p}: the file parsed but holds no graph (truncated or not ONNX?); re-export the model")
    try:
        check_model(model, model_dir(p))
    except InputError as exc:
        raise InputError(f"{p}: {exc}") from None
    return model


def check_model(model: onnx.ModelProto, base_dir: str | None) -> None:
    """What `load_model` checks of a parsed model, for one given in memory too: names, input dims, external data
    (when `base_dir`, the folder its locations are relative to, is known) and onnx.checker on the structure.
    Raise InputError, its message not yet prefixed with where the model came from."""
    try:
        check_names(model)
        check_input_dims(model)
        if base_dir is not None:
            check_external_data(model, base_dir)
        check_structure(model)
    except InputError:
        raise
    except Exception as exc:
        raise InputError(f"invalid ONNX graph: {first_line(exc)}; fix the exporter output or re-export") from None


def check_names(model: onnx.ModelProto) -> None:
    """Every name is UTF-8 text, as ONNX requires. protobuf hands back bytes for a name that is not, which
    no string operation downstream expects."""
    def graph_names(g: onnx.GraphProto, where: str) -> None:
        check(f"{where}graph's name", g.name)
        for kind, items in (("input", g.input), ("output", g.output), ("value_info", g.value_info),
                            ("initializer", g.initializer)):
            for i, v in enumerate(items):
                check(f"{where}{kind} #{i}'s name", v.name)
        for i, n in enumerate(g.node):
            if not plain(n):   # something to say about this node (or a subgraph to walk): the full check
                nodes(n, f"{where}node #{i}")

    def plain(n: onnx.NodeProto) -> bool:
        """True when every name of `n` is text without a line break and no attribute holds a graph: the common
        case, tested in one join (a name protobuf hands back as bytes makes the join raise)."""
        attrs = n.attribute
        try:
            text = "".join((n.name, n.op_type, n.domain, *n.input, *n.output, *(a.name for a in attrs)))
        except TypeError:
            return False
        if "\n" in text or "\r" in text:
            return False
        return not any(a.HasField("g") or a.graphs for a in attrs)

    def nodes(n: onnx.NodeProto, where: str) -> None:
        for field in ("name", "op_type", "domain"):
            check(f"{where}'s {field}", getattr(n, field))
        for kind, names in (("input", n.input), ("output", n.output)):
            for j, v in enumerate(names):
                check(f"{where}'s {kind} #{j}", v)
        for a in n.attribute:
            check(f"{where}'s attribute name", a.name)
            for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                graph_names(sub, f"{where}'s subgraph: ")

    def check(what: str, name: str | bytes) -> None:
        if isinstance(name, bytes):
            bad(what, name)
        elif "\n" in name or "\r" in name:
            # Reports print names inside multi-line text: a line break in a name could forge a line of it
            # (a fake "PASS" under real drift). Other control characters are escaped where printed.
            raise InputError(f"{what} {name!r} contains a line break, which no ONNX exporter writes and which would "
                             "forge lines in npufuse's output; rename it")

    def bad(what: str, raw: bytes) -> None:
        raise InputError(f"{what} {raw!r} is not valid UTF-8 text, which ONNX names must be; rename it "
                         "(re-export the model)")

    if not _plain_graph(model.graph):   # else nothing below could raise: every name is text, no subgraph
        graph_names(model.graph, "")
    for f in model.functions:
        check("a function's name", f.name)
        check(f"function {f.name!r}'s domain", f.domain)
        for i, n in enumerate(f.node):
            nodes(n, f"function {f.name}: node #{i}")


def _plain_graph(g: onnx.GraphProto) -> bool:
    """`check_names`' test of a whole graph at once (a 100k-node graph's names in one join, not one per node):
    True when every name in it is text without a line break and no node attribute holds a graph, so the
    node-by-node walk would find nothing; False sends the graph to that walk, which says what is wrong."""
    nodes = g.node
    attrs = [a for n in nodes if (held := n.attribute) for a in held]
    try:
        text = "".join(chain(
            (g.name,), [v.name for v in g.input], [v.name for v in g.output], [v.name for v in g.value_info],
            [t.name for t in g.initializer], [a.name for a in attrs],
            [s for n in nodes for s in (n.name, n.op_type, n.domain, *n.input, *n.output)]))
    except TypeError:   # a name protobuf handed back as bytes
        return False
    if "\n" in text or "\r" in text:
        return False
    return not any(a.HasField("g") or a.graphs for a in attrs)


def check_input_dims(model: onnx.ModelProto) -> None:
    """A graph input's fixed dims are >= 0 (an exporter writing -1 for 'unknown' meant a symbolic dim)."""
    for v in model.graph.input:
        for axis, d in enumerate(v.type.tensor_type.shape.dim):
            if d.HasField("dim_value") and d.dim_value < 0:
                raise InputError(f"input {v.name!r} has dim {d.dim_value} at axis {axis}; a dim is a size >= 0 "
                                 "or a name (dim_param): make it symbolic, e.g. 'batch', and pass --dim batch=N")


def check_external_data(model: onnx.ModelProto, base_dir: str) -> None:
    """What onnx.checker checks of external data, without reading it: each location is a regular file inside
    the model's folder and holds the bytes it is said to."""
    root = Path(base_dir).resolve()
    sizes: dict[str, int] = {}
    for t in iter_tensors(model):
        if not is_external(t):
            continue
        ref = external_ref(t)
        path = ref.location
        if path not in sizes:
            full = root / ref.location
            if not ref.location or Path(ref.location).is_absolute() or root not in full.resolve().parents:
                raise InputError(f"tensor {t.name!r}: external data location {ref.location!r} is not a file inside "
                                 "the model's folder; re-save the model with relative locations")
            if full.is_symlink() or not full.is_file():
                raise InputError(f"tensor {t.name!r}: its external data file {ref.location!r} is missing (or not a "
                                 "regular file) beside the model; copy it there")
            sizes[path] = full.stat().st_size
        need = ref.offset + (ref.length if ref.length is not None else 0)
        if need > sizes[path]:
            raise InputError(f"tensor {t.name!r}: {ref.location!r} holds {sizes[path]} bytes but the tensor's data "
                             f"ends at byte {need}; the data file is truncated or belongs to another model")


def check_structure(model: onnx.ModelProto) -> None:
    """onnx.checker on the model's structure (nodes, types, opsets, functions) without its weights: each
    referenced tensor is stood in for by an empty one of the same type and rank."""
    if not any(is_external(t) for t in iter_tensors(model)):
        onnx.checker.check_model(model)
        return
    stand_in = onnx.ModelProto()
    _copy_without_weights(model, stand_in)
    onnx.checker.check_model(stand_in)


def _copy_without_weights(model: onnx.ModelProto, into: onnx.ModelProto) -> None:
    into.CopyFrom(model)
    for t in iter_tensors(into):
        if is_external(t):
            t.ClearField("raw_data")
            del t.external_data[:]
            t.data_location = onnx.TensorProto.DEFAULT
            if t.dims:
                t.dims[0] = 0


def model_dir(path: str | os.PathLike) -> str:
    """The folder that external-data locations in the model at `path` are relative to."""
    return str(Path(path).resolve().parent)


def input_data_files(model: onnx.ModelProto, path: str | os.PathLike) -> set[Path]:
    """The external data files of the model at `path` (not the .onnx file itself, which holds embedded weights)."""
    own = Path(path).resolve()
    return {f for f in data_files(model, model_dir(path)) if f != own}


def input_files(model: onnx.ModelProto, path: str | os.PathLike) -> set[Path]:
    """Every file reading the model at `path` touches: the .onnx file and its external data files."""
    return {Path(path).resolve()} | data_files(model, model_dir(path))


def same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """`a` and `b` name one file: the same path once symlinks are resolved, or (both existing) the same inode,
    which also catches a hard link."""
    pa, pb = Path(a), Path(b)
    if pa.resolve() == pb.resolve():
        return True
    try:
        return os.path.samefile(pa, pb)
    except (OSError, ValueError):
        return False


def check_output_path(out: str | os.PathLike, source: str | os.PathLike | None, overwrite_input: bool = False,
                      flag: str = "-o", others: tuple[str | os.PathLike, ...] = (),
                      data_files: set[Path] | frozenset = frozenset()) -> Path:
    """The one check every output path goes through. Refuse an output path that is the input model (unless
    asked), one of the files the input reads (`data_files`; for -o also its own data file `<out>.data`), another
    file of the same run (`others`: other inputs and their data files, other outputs), a folder, or in a folder
    that does not exist or cannot be written. Files compare through symlinks and hard links. `flag` names the
    option in the message. `source` is None for a model given in memory (no input file)."""
    out_p = Path(out)
    if source is not None and same_file(out_p, source) and not overwrite_input:
        hint = " or pass --overwrite" if flag == "-o" else ""
        raise InputError(f"{out_p}: {flag} would overwrite the input model; choose another path{hint}")
    # The model's own data file: an external-data output puts its weights in `<out>.data`.
    written = [out_p] + ([out_p.with_name(out_p.name + ".data")] if flag == "-o" else [])
    model_file = Path(source) if source is not None else None   # None: a model given in memory
    for w in written:
        for r in sorted(data_files) + ([] if w is out_p or model_file is None else [model_file]):
            if same_file(w, r):
                what = "the input model" if r is model_file else "the input's external data file"
                via = "" if w is out_p else f" (with its data file {w.name})"
                raise InputError(f"{out_p}: {flag} would overwrite {what} {r}{via}; choose another path")
    for other in others:
        if same_file(out_p, other):
            raise InputError(f"{out_p}: {flag} names a file this run already reads or writes; choose another path")
    resolved = out_p.resolve()
    parent = resolved.parent
    if not parent.is_dir():
        raise InputError(f"{out_p}: {flag} folder {parent} does not exist; create it or choose another path")
    if not os.access(parent, os.W_OK):
        raise InputError(f"{out_p}: {flag} folder {parent} is not writable; choose another path")
    if out_p.is_dir():
        raise InputError(f"{out_p}: {flag} is a directory; pass a file path")
    for w in written:   # the write renames a new file over the path: a device or FIFO there would be replaced
        if w.exists() and not w.is_file():
            raise InputError(f"{w}: {flag} names a device, FIFO or socket, which the write would replace with a "
                             "regular file; pass a regular file path")
    return out_p


def write_model(model: onnx.ModelProto, out: str | os.PathLike, base_dir: str | None = None, *,
                external: bool | None = None, progress: Progress | None = None, onnx_checker: bool = True,
                structure_checked: bool = False) -> Path:
    """Write `model` to `out` atomically, streaming every referenced weight file to file (never through Python
    objects), and check the result with onnx.checker by path.

    `onnx_checker=False` is for the ATC form, which onnx.checker refuses by design (the literal `ai.onnx` domain
    released ATC needs, ops in ATC's `npu` domain): its caller runs ATC's own pre-check instead.

    `structure_checked=True`: the caller has run `check_structure` on `model` itself (the engine does on every
    result), so onnx.checker's pass over the same nodes, types and functions is not repeated (on a 100k-node graph
    it costs a load and a check); what writing adds, the external data the written model refers to, is still
    checked (`check_external_data`).

    `external`: True writes the weights to `<out>.data` beside the model (locations relative), False embeds them,
    None embeds unless the model would pass protobuf's 2 GiB limit. With external data, when the output's
    weights are exactly one input data file's (nothing folded, most of it still used), `<out>.data` is a reflink
    of that file where the filesystem can clone; else the tensors are copied in the kernel, holes skipped.
    """
    out_p = Path(out)
    if not external:   # None, or embedded unless past protobuf's limit: external data exactly when past it
        external = sum(tensor_nbytes(t) for t in iter_tensors(model)) + _structure_bytes(model) > _PROTOBUF_LIMIT_BYTES
    if not external and onnx_checker and not structure_checked:  # an external one is checked once written
        check_structure(model)
    skeleton = onnx.ModelProto()
    skeleton.CopyFrom(model)  # structure and the few tensors a rewrite computed; weights are references
    progress = progress or Progress.silent()
    try:
        if external:
            _write_external(skeleton, out_p, base_dir, progress)
        else:
            _write_embedded(skeleton, out_p, base_dir, progress)
    except OSError as exc:
        raise InputError(f"{out_p}: cannot write the output model ({exc.strerror or exc}); choose another path") \
            from None
    if external and onnx_checker:
        if structure_checked:
            check_external_data(skeleton, model_dir(out_p))
        else:
            onnx.checker.check_model(str(out_p))
    return out_p


def _structure_bytes(model: onnx.ModelProto) -> int:
    """The serialized size of everything but referenced weights (cheap: no ByteSize over a large model)."""
    return sum(n.ByteSize() for n in model.graph.node) + sum(f.ByteSize() for f in model.functions) + sum(
        t.ByteSize() for t in model.graph.initializer if not is_external(t))


def _write_embedded(skeleton: onnx.ModelProto, out: Path, base_dir: str | None, progress: Progress) -> None:
    """One .onnx file: the structure serialized, then each referenced initializer appended as a graph field whose
    raw_data is streamed from its file (protobuf merges repeated occurrences of the graph field)."""
    for t in nested_tensors(skeleton):  # referenced tensors outside the main graph's initializers: rare and small
        if is_external(t):
            _inline(t, base_dir)
    streamed = [t for t in skeleton.graph.initializer if is_external(t)]
    kept = [t for t in skeleton.graph.initializer if not is_external(t)]
    sources = [_source(t, base_dir) for t in streamed]
    headers = []
    for t in streamed:
        header = onnx.TensorProto()
        header.CopyFrom(t)
        del header.external_data[:]
        header.ClearField("data_location")
        headers.append(header.SerializeToString())
    del skeleton.graph.initializer[:]
    skeleton.graph.initializer.extend(kept)
    entries = [h + len_field(9, src.length) for h, src in zip(headers, sources)]
    entry_sizes = [len(e) + src.length for e, src in zip(entries, sources)]
    graph_tail = sum(len(len_field(5, n)) + n for n in entry_sizes)
    head = skeleton.SerializeToString() + (len_field(7, graph_tail) if streamed else b"")

    def write(tmp: str) -> None:
        with open(tmp, "r+b") as f, progress.stage("write model", sum(s.length for s in sources), "B") as stage:
            fd = f.fileno()
            pos = _pwrite(fd, head, 0)
            for entry, size, src in zip(entries, entry_sizes, sources):
                pos = _pwrite(fd, len_field(5, size) + entry, pos)
                pos = _copy_source(src, fd, pos, stage)
            os.ftruncate(fd, pos)

    atomic_write(out, write, "the output model")


def _write_external(skeleton: onnx.ModelProto, out: Path, base_dir: str | None, progress: Progress) -> None:
    """`<out>` holds the structure, `<out>.data` every tensor of REFERENCE_THRESHOLD_BYTES or more."""
    data_name = out.name + ".data"
    tensors = [t for t in iter_tensors(skeleton) if is_external(t) or tensor_nbytes(t) >= REFERENCE_THRESHOLD_BYTES]
    sources = [_source(t, base_dir) for t in tensors]
    out_dir = out.resolve().parent
    remove_stale_temps(out)
    with tempfile.TemporaryDirectory(prefix=_temp_prefix(out), suffix=_TEMP_SUFFIX, dir=str(out_dir)) as tmp_dir:
        tmp_data = Path(tmp_dir) / data_name
        shared = _shareable_file(sources)
        if shared is not None and _share_file(shared, tmp_data):
            for t, src in zip(tensors, sources):
                set_external_ref(t, data_name, src.offset, src.length)
        else:
            layout: dict[tuple, int] = {}   # a range read twice (tied weights) is written once
            pos = 0
            with open(tmp_data, "wb") as f, progress.stage("write weights", sum(s.length for s in sources), "B") \
                    as stage, _OpenFiles() as files:
                fd = f.fileno()
                for t, src in zip(tensors, sources):
                    key = src.key()
                    if key not in layout:
                        pos = _align(pos, 4096 if src.length >= 1 << 16 else 64)
                        layout[key] = pos
                        pos = _copy_source(src, fd, pos, stage, files)
                    set_external_ref(t, data_name, layout[key], src.length)
                os.ftruncate(fd, pos)
        tmp_model = Path(tmp_dir) / out.name
        tmp_model.write_bytes(skeleton.SerializeToString())
        # The data first: a reader never finds the new model beside old weights.
        # Both were created by open(), so they have the permissions the umask gives (and a shared data file
        # keeps the input's: it is the input's file).
        for f in (tmp_data, tmp_model):
            os.replace(f, out.with_name(f.name))


@dataclass
class _Source:
    """Where one tensor's bytes come from: a range of a file, or bytes a rewrite computed."""

    length: int
    path: Path | None = None
    offset: int = 0
    data: bytes = b""

    def key(self) -> tuple:
        return (str(self.path), self.offset, self.length) if self.path is not None else ("mem", id(self.data))


def _source(t: onnx.TensorProto, base_dir: str | None) -> _Source:
    if is_external(t):
        if base_dir is None:
            raise ValueError(f"tensor {t.name!r} is stored outside the model but its folder is unknown")
        ref = external_ref(t)
        path = ref.path(base_dir)
        length = ref.length if ref.length is not None else path.stat().st_size - ref.offset
        return _Source(length, path, ref.offset)
    data = t.raw_data if t.raw_data else read_array(t, None).tobytes()
    return _Source(len(data), data=data)


def _inline(t: onnx.TensorProto, base_dir: str | None) -> None:
    data = read_array(t, base_dir).tobytes()
    del t.external_data[:]
    t.data_location = onnx.TensorProto.DEFAULT
    t.raw_data = data


def _copy_source(src: _Source, fd: int, pos: int, stage, files: _OpenFiles | None = None) -> int:
    """Write `src` at `pos` in `fd`; returns the position after it. File ranges are copied in the kernel
    (copy_file_range), and holes of a sparse source stay holes. `files`: source files kept open across calls
    (thousands of tensors in one data file are read through one descriptor)."""
    if src.path is None:
        _pwrite(fd, src.data, pos)
        stage.advance(src.length)
        return pos + src.length
    if files is not None:
        _copy_range(files.fd(src.path), src.offset, fd, pos, src.length, stage)
        return pos + src.length
    with open(src.path, "rb") as f:
        _copy_range(f.fileno(), src.offset, fd, pos, src.length, stage)
    return pos + src.length


class _OpenFiles:
    """Source files opened for reading once each, closed together (every read gives its offset: none moves a
    file position another read relies on)."""

    def __init__(self) -> None:
        self._open: dict[Path, object] = {}

    def fd(self, path: Path) -> int:
        f = self._open.get(path)
        if f is None:
            f = self._open[path] = open(path, "rb")
        return f.fileno()

    def __enter__(self) -> _OpenFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        for f in self._open.values():
            f.close()
        self._open.clear()


_CHUNK_BYTES = 8 << 20


def _copy_range(src_fd: int, src_off: int, dst_fd: int, dst_off: int, length: int, stage) -> None:
    end = src_off + length
    pos = src_off
    while pos < end:
        try:  # skip holes: a sparse source (or a real model's padding) costs neither reads nor writes
            data = os.lseek(src_fd, pos, os.SEEK_DATA)
            hole = os.lseek(src_fd, data, os.SEEK_HOLE)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # nothing but a hole up to the end of the file
                break
            data, hole = pos, end
        if data >= end:
            break
        stop = min(hole, end)
        _copy_bytes(src_fd, data, dst_fd, dst_off + (data - src_off), stop - data)
        stage.advance(stop - pos)
        pos = stop
    stage.advance(end - pos) if pos < end else None


def _copy_bytes(src_fd: int, src_off: int, dst_fd: int, dst_off: int, n: int) -> None:
    while n > 0:
        try:
            done = os.copy_file_range(src_fd, dst_fd, min(n, 1 << 30), src_off, dst_off)
        except OSError:
            done = 0
        if done <= 0:  # no kernel copy here (another filesystem, an old kernel): plain chunked reads
            chunk = os.pread(src_fd, min(n, _CHUNK_BYTES), src_off)
            if not chunk:
                raise OSError(errno.EIO, f"unexpected end of file while copying weights at byte {src_off}")
            done = _pwrite(dst_fd, chunk, dst_off) - dst_off
        src_off, dst_off, n = src_off + done, dst_off + done, n - done


def _pwrite(fd: int, data: bytes, pos: int) -> int:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, pos)
        view, pos = view[n:], pos + n
    return pos


def _align(pos: int, alignment: int) -> int:
    return -(-pos // alignment) * alignment


def _shareable_file(sources: list[_Source]) -> Path | None:
    """The one data file every tensor comes from, if the output may share it: nothing computed, and at least half
    of the file still used (else a fresh, compact copy is better)."""
    paths = {s.path for s in sources}
    if not sources or None in paths or len(paths) != 1:
        return None
    path = paths.pop()
    if path.suffix == ".onnx":  # the weights were embedded in the input model: not a data file to share
        return None
    used = sum(s.length for s in {s.key(): s for s in sources}.values())
    return path if used * 2 >= path.stat().st_size else None


def _share_file(src: Path, dst: Path) -> bool:
    """Make `dst` the same bytes as `src` without copying them: a reflink (copy-on-write clone), where the
    filesystem has them (btrfs, XFS, ...). Not a hard link: onnx.checker refuses a data file with several links
    (a "hardlink attack"), and a user writing to one name would change the other."""
    try:
        import fcntl

        with open(src, "rb") as fs, open(dst, "wb") as fd:
            fcntl.ioctl(fd.fileno(), _FICLONE, fs.fileno())
        return True
    except OSError:
        dst.unlink(missing_ok=True)
        return False


_FICLONE = 0x40049409  # linux/fs.h


def atomic_write(out: str | os.PathLike, write: Callable[[str], None], what: str = "the file") -> Path:
    """Call `write(tmp_path)` on a temp file beside `out`, then rename it over `out`: a reader sees the old
    file or the whole new one, never half of it. InputError (one line) when it cannot be written. The temp file
    is removed on any error or interrupt; one a killed run left is removed by the next write of `out`."""
    out_p = Path(out)
    tmp = None
    try:
        remove_stale_temps(out_p)
        fd, tmp = tempfile.mkstemp(prefix=_temp_prefix(out_p), suffix=_TEMP_SUFFIX, dir=str(out_p.resolve().parent))
        os.close(fd)
        write(tmp)
        _chmod_like_umask(tmp)
        os.replace(tmp, out_p)
    except OSError as exc:
        raise InputError(f"{out_p}: cannot write {what} ({exc.strerror or exc}); choose another path") from None
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
    return out_p


# Temp files and folders of a write to OUT are named `.OUT.<pid>.<8 random chars>.tmp` in OUT's folder: the
# rename that publishes them must stay on one filesystem. SIGKILL (or a power cut) leaves one behind.
_TEMP_SUFFIX = ".tmp"
# A temp whose writer is gone is removed only once untouched this long: on a shared (network) folder the pid
# may be another host's, whose live write keeps touching the file.
STALE_TEMP_AGE_S = 60.0


def _temp_prefix(out: Path) -> str:
    return f".{out.name}.{os.getpid()}."


def remove_stale_temps(out: str | os.PathLike) -> list[Path]:
    """Remove what killed writes of `out` left beside it: entries named like our temps of exactly this output
    (`.OUT.<pid>.<random>.tmp`) whose pid is not a live process and that nobody touched for STALE_TEMP_AGE_S.
    A live pid (maybe a reused one) keeps its file: a leftover is harmless, deleting a running write is not.
    Returns what was removed."""
    import re
    import shutil
    import time

    out_p = Path(out)
    parent = out_p.resolve().parent
    pattern = re.compile(re.escape(f".{out_p.name}.") + r"([0-9]+)\.[A-Za-z0-9_]{8}" + re.escape(_TEMP_SUFFIX))
    removed = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return removed
    now = time.time()
    for e in entries:
        m = pattern.fullmatch(e.name)
        if m is None or _pid_alive(int(m.group(1))):
            continue
        try:
            st = e.stat(follow_symlinks=False)
            if now - st.st_mtime < STALE_TEMP_AGE_S:
                continue
            if e.is_dir(follow_symlinks=False):
                shutil.rmtree(e.path)
            else:
                os.unlink(e.path)
            removed.append(Path(e.path))
        except OSError:
            pass  # gone meanwhile, or not ours to remove: leave it
    return removed


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, OSError):
        return True  # someone else's live process, or not a pid we can ask about: assume alive
    return True


def _chmod_like_umask(path: str) -> None:
    """Temp files are created 0600; the file we hand over gets the permissions a plain open() would give."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)
