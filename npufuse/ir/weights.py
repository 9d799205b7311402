"""Weights stay where they are: initializers as references to bytes on disk, read only when a rewrite needs them.

npufuse's memory must follow what it changes, not the model. So a loaded model holds no weight bytes:

- weights already in external data files keep their references (location, offset, length);
- weights embedded in the .onnx file become references too: `load_skeleton` walks the protobuf wire format
  over a memory map and, for every initializer whose `raw_data` is large, records where its bytes lie in the
  .onnx file instead of copying them (an ONNX external-data reference whose location is the model file itself).

Reading a referenced tensor memory-maps its file (`read_array`): pages are read when touched and belong to the
page cache, not to npufuse. Writing the output streams those bytes file to file (see `modelio.write_model`).
"""

from __future__ import annotations

import functools
import mmap
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

# An embedded raw_data payload at least this big becomes a reference; smaller ones (shapes, scalars, small
# vectors) stay in the graph where patterns read them constantly.
REFERENCE_THRESHOLD_BYTES = 1024

# Protobuf wire types and the field numbers of onnx.proto3 that the scanner needs.
_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5
_MODEL_GRAPH = 7
_GRAPH_INITIALIZER = 5
_TENSOR_RAW_DATA, _TENSOR_EXTERNAL_DATA, _TENSOR_DATA_LOCATION = 9, 13, 14


class WireFormatError(ValueError):
    """The file is not a well-formed protobuf message."""


@dataclass(frozen=True)
class ExternalRef:
    """Where an external tensor's bytes lie: `location` relative to the model's folder."""

    location: str
    offset: int
    length: int | None

    def path(self, base_dir: str | os.PathLike) -> Path:
        return _joined(str(base_dir), self.location)


@functools.lru_cache(maxsize=1024)
def _joined(base_dir: str, location: str) -> Path:
    return Path(base_dir) / location


def is_external(t: onnx.TensorProto) -> bool:
    return t.data_location == onnx.TensorProto.EXTERNAL


def external_ref(t: onnx.TensorProto) -> ExternalRef:
    entries = {e.key: e.value for e in t.external_data}
    length = entries.get("length")
    return ExternalRef(entries.get("location", ""), int(entries.get("offset", 0) or 0),
                       int(length) if length else None)


def set_external_ref(t: onnx.TensorProto, location: str, offset: int, length: int) -> None:
    """Make `t` a reference to `length` bytes at `offset` in `location` (dropping any data it held)."""
    t.ClearField("raw_data")
    del t.external_data[:]
    t.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = t.external_data.add()
        entry.key, entry.value = key, value


def element_size_bytes(data_type: int) -> float:
    """Bytes per element (fractional for the packed 4-bit and 2-bit types)."""
    if data_type in (onnx.TensorProto.INT4, onnx.TensorProto.UINT4, getattr(onnx.TensorProto, "FLOAT4E2M1", -1)):
        return 0.5
    dt = np_dtype_or_none(data_type)
    return float(dt.itemsize) if dt is not None else 0.0


def tensor_nbytes(t: onnx.TensorProto) -> int:
    """Bytes of a tensor's data, without reading it."""
    if is_external(t):
        ref = external_ref(t)
        if ref.length is not None:
            return ref.length
    elif t.raw_data:
        return len(t.raw_data)
    return int(np.prod(t.dims, dtype=np.int64) * element_size_bytes(t.data_type))


def np_dtype_or_none(data_type: int) -> np.dtype | None:
    try:
        return np.dtype(helper.tensor_dtype_to_np_dtype(data_type))
    except (KeyError, TypeError, ValueError):
        return None


# ---- reading ------------------------------------------------------------------------------------------------

_maps: dict[tuple[str, int, int], mmap.mmap] = {}
_maps_lock = threading.Lock()


def _file_map(path: Path) -> mmap.mmap | None:
    """A read-only map of `path`, shared by every tensor read from it (None for an empty file)."""
    st = path.stat()
    key = (str(path.resolve()), st.st_ino, st.st_mtime_ns)
    with _maps_lock:
        mm = _maps.get(key)
        if mm is None:
            if st.st_size == 0:
                return None
            with open(path, "rb") as f:
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            _maps[key] = mm
        return mm


# Plain little-endian layouts numpy reads directly from raw bytes; packed and string types go through onnx.
_PACKED_OR_STRING = {onnx.TensorProto.STRING, onnx.TensorProto.INT4, onnx.TensorProto.UINT4,
                     getattr(onnx.TensorProto, "FLOAT4E2M1", -1)}


def read_array(t: onnx.TensorProto, base_dir: str | os.PathLike | None) -> np.ndarray:
    """The tensor's value. An external tensor is a read-only view of its memory-mapped file (no copy)."""
    if not is_external(t):
        return numpy_helper.to_array(t)
    ref = external_ref(t)
    if base_dir is None:
        raise FileNotFoundError(f"tensor {t.name!r} is stored in {ref.location!r}, but the model's folder is unknown")
    path = ref.path(base_dir)
    dtype = np_dtype_or_none(t.data_type)
    count = int(np.prod(t.dims, dtype=np.int64))
    mm = _file_map(path)
    length = ref.length if ref.length is not None else (len(mm) - ref.offset if mm is not None else 0)
    if mm is None or ref.offset + length > len(mm):
        raise ValueError(f"tensor {t.name!r}: {length} bytes at offset {ref.offset} lie beyond the end of {path}")
    if dtype is None or t.data_type in _PACKED_OR_STRING or dtype.itemsize * count != length:
        # Rare layouts: hand onnx a copy of the bytes.
        copy = onnx.TensorProto()
        copy.CopyFrom(t)
        del copy.external_data[:]
        copy.data_location = onnx.TensorProto.DEFAULT
        copy.raw_data = bytes(mm[ref.offset:ref.offset + length])
        return numpy_helper.to_array(copy)
    arr = np.frombuffer(mm, dtype=dtype.newbyteorder("<"), count=count, offset=ref.offset)
    return arr.reshape(tuple(t.dims))


def data_files(model: onnx.ModelProto, base_dir: str | os.PathLike) -> set[Path]:
    """Resolved paths of every file the model's external tensors live in."""
    locations = {external_ref(t).location for t in iter_tensors(model) if is_external(t)}
    return {(Path(base_dir) / loc).resolve() for loc in locations}


def iter_tensors(model: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    """Every tensor of the model that can hold weights: the main graph's initializers first, then those of
    subgraphs and functions, and Constant nodes' values."""
    yield from model.graph.initializer
    yield from nested_tensors(model)


# Standard ops whose attributes can hold a tensor or a graph; every other standard op's attributes are plain.
_TENSOR_HOLDING_OPS = frozenset({"Constant", "ConstantOfShape", "If", "Loop", "Scan", "SequenceMap"})
_PLAIN_DOMAINS = frozenset({"", "ai.onnx"})


def nested_tensors(model: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    """The tensors `iter_tensors` gives after the main graph's initializers."""
    def in_nodes(nodes) -> Iterator[onnx.TensorProto]:
        for n in nodes:
            if n.domain in _PLAIN_DOMAINS and n.op_type not in _TENSOR_HOLDING_OPS:
                continue   # the hot path: a standard op without tensor or graph attributes
            for a in n.attribute:
                if a.type == onnx.AttributeProto.TENSOR:
                    yield a.t
                elif a.type == onnx.AttributeProto.TENSORS:
                    yield from a.tensors
                elif a.type == onnx.AttributeProto.GRAPH:
                    yield from in_graph(a.g)
                elif a.type == onnx.AttributeProto.GRAPHS:
                    for sub in a.graphs:
                        yield from in_graph(sub)

    def in_graph(g: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
        yield from g.initializer
        yield from in_nodes(g.node)

    yield from in_nodes(model.graph.node)
    for f in model.functions:
        yield from in_nodes(f.node)


# ---- loading: the wire-format scanner -----------------------------------------------------------------------

def _read_varint(buf: mmap.mmap | bytes, pos: int, end: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= end:
            raise WireFormatError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise WireFormatError("varint too long")


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        b = value & 0x7F
        value >>= 7
        if value:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _tag(field: int, wire_type: int) -> bytes:
    return _varint(field << 3 | wire_type)


def len_field(field: int, payload_len: int) -> bytes:
    """The tag and length prefix of a length-delimited field (its payload follows)."""
    return _tag(field, _LEN) + _varint(payload_len)


def _fields(buf: mmap.mmap, pos: int, end: int) -> Iterator[tuple[int, int, int, int, int]]:
    """(field number, wire type, field start, payload start, field end) for each field of a message."""
    while pos < end:
        start = pos
        key = buf[pos]   # one-byte varints (the tags of fields 1..15, short lengths) read inline: the hot path
        if key < 0x80:
            pos += 1
        else:
            key, pos = _read_varint(buf, pos, end)
        field, wire = key >> 3, key & 7
        if wire == _VARINT:
            _, pos = _read_varint(buf, pos, end)
            payload = pos
        elif wire == _I64:
            payload, pos = pos, pos + 8
        elif wire == _I32:
            payload, pos = pos, pos + 4
        elif wire == _LEN:
            if pos < end and buf[pos] < 0x80:
                n, payload = buf[pos], pos + 1
            else:
                n, payload = _read_varint(buf, pos, end)
            pos = payload + n
        else:
            raise WireFormatError(f"unsupported wire type {wire}")
        if pos > end:
            raise WireFormatError("field runs past the end of its message")
        yield field, wire, start, payload, pos


def _scan_tensor(buf: mmap.mmap, start: int, end: int, location: str, threshold: int) -> bytes | None:
    """The tensor's bytes with a large raw_data replaced by a reference into the file; None if unchanged."""
    fields = list(_fields(buf, start, end))
    raw = next(((payload, fend - payload) for field, wire, _, payload, fend in fields
                if field == _TENSOR_RAW_DATA and wire == _LEN and fend - payload >= threshold), None)
    if raw is None:
        return None
    out = bytearray()
    for field, _, fstart, _, fend in fields:
        if field not in (_TENSOR_RAW_DATA, _TENSOR_DATA_LOCATION, _TENSOR_EXTERNAL_DATA):
            out += buf[fstart:fend]
    ref = onnx.TensorProto()
    set_external_ref(ref, location, raw[0], raw[1])
    out += ref.SerializeToString()  # only data_location and external_data: appended fields merge into the tensor
    return bytes(out)


def _scan_message(buf: mmap.mmap, start: int, end: int, field_handlers: dict) -> bytes | None:
    """Copy a message's fields, letting `field_handlers[field](start, end)` rewrite length-delimited ones;
    None when nothing changed (unchanged runs of fields are copied as one slice)."""
    out = bytearray()
    changed = False
    run_start = start
    for field, wire, fstart, payload, fend in _fields(buf, start, end):
        handler = field_handlers.get(field)
        if handler is None or wire != _LEN:
            continue
        new = handler(payload, fend)
        if new is None:
            continue
        changed = True
        out += buf[run_start:fstart]
        out += len_field(field, len(new)) + new
        run_start = fend
    if not changed:
        return None
    out += buf[run_start:end]
    return bytes(out)


def load_skeleton(path: str | os.PathLike, threshold: int = REFERENCE_THRESHOLD_BYTES) -> onnx.ModelProto:
    """The model at `path` with every large embedded initializer turned into a reference to its bytes in the
    file (location = the file's own name, relative to its folder). Memory: the graph's structure, not its
    weights. External tensors keep their references."""
    p = Path(path)
    size = p.stat().st_size
    model = onnx.ModelProto()
    if size == 0:
        return model
    with open(p, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        location = p.name
        graph_handlers = {_GRAPH_INITIALIZER: lambda a, b: _scan_tensor(mm, a, b, location, threshold)}
        model_handlers = {_MODEL_GRAPH: lambda a, b: _scan_message(mm, a, b, graph_handlers)}
        skeleton = _scan_message(mm, 0, size, model_handlers)
        model.ParseFromString(skeleton if skeleton is not None else mm[:])
    finally:
        mm.close()
    return model
