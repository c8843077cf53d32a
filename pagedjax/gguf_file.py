"""A GGUF file's metadata and tensor table, parsed once in one pass over its header.

Contract: ``parse_gguf(path)`` reads the header (magic, version, counts), every typed
key/value pair and the tensor-info table, and returns a ``GGUFFile`` whose ``metadata``
maps each key to exactly what gguf-py's ``GGUFReader(path).fields[key].contents()``
returns (Python ints / floats / bools / str, and flat lists for arrays, nested arrays
flattened as gguf-py flattens them), the three pseudo-fields ``GGUF.version``,
``GGUF.tensor_count`` and ``GGUF.kv_count`` included. ``tensors`` lists the tensor table
in file order (name, dims innermost first, ggml type id, offsets); ``tensor_data(t)`` is
the same read-only memory map view as gguf-py's ``ReaderTensor.data`` (dtype and shape
included), so ``gguf.quants.dequantize`` reads it unchanged.

Why our own reader: gguf-py builds a numpy memmap view for every element of every value
(each token string is two views), so ``GGUFReader(...)`` on SmolLM2's 49k-token
vocabulary + 48k merges took ~8-10 s of a ~21 s engine build, and pagedjax (and
transformers, for the tokenizer) built it several times per build. Here the header is
one ``bytes`` object: scalars come from ``struct``, numeric arrays from one
``np.frombuffer`` each, and a string array is a tight loop over ``struct.unpack_from``
lengths with the bytes sliced and decoded (a string's offset depends on every length
before it, so this loop is the one sequential part): ~0.1 s for the same file.

Refusals (ValueError, naming the file): a bad magic, a version other than 2 or 3 (what
gguf-py reads), an unknown value type, a duplicate key or tensor name, a bad
``general.alignment`` (not a u32 power of two), a header that runs past the end of the
file. Files written in the other byte order are read as gguf-py reads them (detected from
the version field). Needs numpy only; ``tensor_data`` needs the ``gguf`` package for the
block sizes of quantized types.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# GGUF value types (gguf-py's GGUFValueType) -> numpy scalar type; 8 string, 9 array.
STRING, ARRAY = 8, 9
_NUMPY_TYPES: dict[int, type[np.generic]] = {
    0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
    6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64,
}  # fmt: skip
_SIZES = {t: np.dtype(np_t).itemsize for t, np_t in _NUMPY_TYPES.items()}

# ggml tensor types gguf-py exposes as values (anything else: raw uint8 blocks).
_TENSOR_VALUE_TYPES: dict[int, type[np.generic]] = {
    0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64,
    28: np.float64,
}  # fmt: skip

# The first read covers most headers whole; a longer one is read again at its size.
_FIRST_READ = 8 << 20


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One entry of the tensor table. dims: GGUF order, innermost (fastest) first, as
    gguf-py's ``ReaderTensor.shape``; offset: from the start of the data section, as
    written; data_offset: from the start of the file."""

    name: str
    dims: tuple[int, ...]
    type_id: int
    offset: int
    data_offset: int

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.dims, dtype=np.int64))

    @property
    def type_name(self) -> str:
        """gguf-py's name of the ggml type (``"Q4_1"``); needs the ``gguf`` package."""
        from gguf.constants import GGMLQuantizationType

        return GGMLQuantizationType(self.type_id).name

    @property
    def n_bytes(self) -> int:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(self.type_id)]
        return self.n_elements * size // block


@dataclass(frozen=True)
class GGUFFile:
    """A parsed GGUF header (see the module docstring). value_types: the type codes of
    each key as gguf-py's ``field.types`` lists them (outer first)."""

    path: Path
    version: int
    byte_order: str  # "<" little-endian or ">" big-endian
    metadata: dict[str, Any]
    value_types: dict[str, tuple[int, ...]]
    tensors: tuple[GGUFTensorInfo, ...]
    alignment: int
    data_offset: int

    @property
    def tensor_names(self) -> set[str]:
        return {t.name for t in self.tensors}

    @cached_property
    def _memmap(self) -> np.memmap:
        return np.memmap(self.path, mode="r")

    def tensor_data(self, t: GGUFTensorInfo) -> np.ndarray:
        """The tensor's bytes as gguf-py's ``ReaderTensor.data``: a read-only memmap view,
        values [*reversed(dims)] for F32/F16/F64/I8..I64, else uint8 blocks
        [*reversed(dims)[:-1], bytes per row]. The file is mapped once, on first use."""
        shape = tuple(reversed(t.dims))
        np_t = _TENSOR_VALUE_TYPES.get(t.type_id)
        if np_t is None:
            from gguf.constants import GGMLQuantizationType
            from gguf.quants import quant_shape_to_byte_shape

            count, np_t = t.n_bytes, np.uint8
            shape = quant_shape_to_byte_shape(shape, GGMLQuantizationType(t.type_id))
        else:
            count = t.n_elements
        dtype = np.dtype(np_t).newbyteorder(self.byte_order)
        end = t.data_offset + count * dtype.itemsize
        return self._memmap[t.data_offset : end].view(dtype)[:count].reshape(shape)


class _Header:
    """A cursor over the header bytes (one ``bytes`` object; struct reads from it)."""

    def __init__(self, path: Path, buf: bytes, order: str):
        self.path, self.buf, self.order, self.pos = path, buf, order, 0
        self.u32 = struct.Struct(order + "I")
        self.u64 = struct.Struct(order + "Q")

    def need(self, n: int) -> None:
        if self.pos + n > len(self.buf):
            raise _Short(self.pos + n)

    def read_u32(self) -> int:
        self.need(4)
        (v,) = self.u32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return v

    def read_u64(self) -> int:
        self.need(8)
        (v,) = self.u64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return v

    def read_bytes(self) -> bytes:
        n = self.read_u64()
        self.need(n)
        b = self.buf[self.pos : self.pos + n]
        self.pos += n
        return b

    def read_str(self) -> str:
        return self.read_bytes().decode("utf-8")

    def read_scalars(self, vtype: int, count: int) -> list[Any]:
        n = _SIZES[vtype] * count
        self.need(n)
        dtype = np.dtype(_NUMPY_TYPES[vtype]).newbyteorder(self.order)
        values = np.frombuffer(self.buf, dtype, count, self.pos).tolist()
        self.pos += n
        return values

    def read_string_array(self, count: int) -> list[bytes]:
        """count strings (u64 length + bytes each) as raw bytes."""
        buf, pos, unpack, end = self.buf, self.pos, self.u64.unpack_from, len(self.buf)
        out = []
        append = out.append
        for _ in range(count):
            if pos + 8 > end:
                raise _Short(pos + 8)
            (n,) = unpack(buf, pos)
            pos += 8
            if pos + n > end:
                raise _Short(pos + n)
            append(buf[pos : pos + n])
            pos += n
        self.pos = pos
        return out


class _Short(Exception):
    """The header needs more bytes than were read (carries how many)."""

    def __init__(self, needed: int):
        self.needed = needed


# A leaf of a (possibly nested) array: (value type, values). Strings stay bytes until the
# field's contents are formed, since gguf-py's flattening may show them as byte lists.
_Leaf = tuple[int, list[Any]]


def _read_value(h: _Header, vtype: int) -> tuple[list[_Leaf], list[int]]:
    """One value -> (its leaves, its type chain as gguf-py's field.types)."""
    if vtype in _NUMPY_TYPES:
        return [(vtype, h.read_scalars(vtype, 1))], [vtype]
    if vtype == STRING:
        return [(STRING, [h.read_bytes()])], [STRING]
    if vtype == ARRAY:
        itype, count = h.read_u32(), h.read_u64()
        if itype in _NUMPY_TYPES:
            return [(itype, h.read_scalars(itype, count))], [ARRAY] + ([itype] if count else [])
        if itype == STRING:
            return [(STRING, h.read_string_array(count))], [ARRAY] + ([STRING] if count else [])
        if itype == ARRAY:
            leaves: list[_Leaf] = []
            types = [ARRAY]
            for i in range(count):
                sub_leaves, sub_types = _read_value(h, ARRAY)
                leaves += sub_leaves
                if i == 0:  # gguf-py types an array by its first element
                    types += sub_types
            return leaves, types
        raise ValueError(f"{h.path}: unknown GGUF array element type {itype}")
    raise ValueError(f"{h.path}: unknown GGUF value type {vtype}")


def _contents(leaves: list[_Leaf], types: list[int], order: str) -> Any:
    """What gguf-py's ``ReaderField.contents()`` gives for these leaves and types."""
    if types[0] != ARRAY:
        vtype, (value,) = leaves[0]
        return value.decode("utf-8") if vtype == STRING else value
    if types[-1] == STRING:  # every leaf shown as a string, as gguf-py's to_string does
        out: list[Any] = []
        for vtype, values in leaves:
            if vtype == STRING:
                out += [v.decode("utf-8") for v in values]
            else:  # a numeric leaf's raw bytes as text (an array typed by a string element)
                dtype = np.dtype(_NUMPY_TYPES[vtype]).newbyteorder(order)
                out += [np.array([v], dtype).tobytes().decode("utf-8") for v in values]
        return out
    out = []
    for vtype, values in leaves:
        if vtype == STRING:  # a string under a numeric type: its bytes as ints
            for v in values:
                out += list(v)
        else:
            out += values
    return out


def _parse(path: Path, buf: bytes) -> GGUFFile:
    if buf[:4] != GGUF_MAGIC:
        raise ValueError(f"{path}: not a GGUF file (bad magic {buf[:4]!r})")
    if len(buf) < 24:
        raise _Short(24)
    (raw_version,) = struct.unpack_from("=I", buf, 4)
    # gguf-py's byte-order test: a version whose low 16 bits are 0 was written swapped.
    native = "<" if np.little_endian else ">"
    swapped = ">" if native == "<" else "<"
    order = swapped if raw_version & 0xFFFF == 0 else native
    h = _Header(path, buf, order)
    h.pos = 4
    version = h.read_u32()
    if version not in SUPPORTED_VERSIONS:
        raise ValueError(f"{path}: GGUF version {version} is not supported ({SUPPORTED_VERSIONS})")
    tensor_count, kv_count = h.read_u64(), h.read_u64()
    metadata: dict[str, Any] = {
        "GGUF.version": version, "GGUF.tensor_count": tensor_count, "GGUF.kv_count": kv_count,
    }  # fmt: skip
    value_types: dict[str, tuple[int, ...]] = {
        "GGUF.version": (4,), "GGUF.tensor_count": (10,), "GGUF.kv_count": (10,),
    }  # fmt: skip
    for _ in range(kv_count):
        key = h.read_str()
        if key in metadata:
            raise ValueError(f"{path}: duplicate GGUF key {key!r}")
        leaves, types = _read_value(h, h.read_u32())
        metadata[key] = _contents(leaves, types, order)
        value_types[key] = tuple(types)

    raw_tensors = []
    for _ in range(tensor_count):
        name = h.read_str()
        n_dims = h.read_u32()
        dims = tuple(h.read_scalars(10, n_dims))
        type_id, offset = h.read_u32(), h.read_u64()
        raw_tensors.append((name, dims, type_id, offset))

    alignment = DEFAULT_ALIGNMENT
    if "general.alignment" in metadata:
        alignment = metadata["general.alignment"]
        if value_types["general.alignment"] != (4,):
            raise ValueError(f"{path}: general.alignment must be a uint32")
        if alignment == 0 or alignment & (alignment - 1):
            raise ValueError(f"{path}: general.alignment {alignment} is not a power of two")
    data_offset = -(-h.pos // alignment) * alignment
    names: set[str] = set()
    tensors = []
    for name, dims, type_id, offset in raw_tensors:
        if name in names:
            raise ValueError(f"{path}: duplicate GGUF tensor {name!r}")
        names.add(name)
        tensors.append(GGUFTensorInfo(name, dims, type_id, offset, data_offset + offset))
    return GGUFFile(path, version, order, metadata, value_types, tuple(tensors), alignment,
                    data_offset)  # fmt: skip


def parse_gguf(path: str | Path) -> GGUFFile:
    """The file's metadata and tensor table (see the module docstring); reads only the
    header (the first 8 MiB, or more when the header is longer). FileNotFoundError for a
    missing file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    size = path.stat().st_size
    want = min(size, _FIRST_READ)
    while True:
        with open(path, "rb") as f:
            buf = f.read(want)
        try:
            return _parse(path, buf)
        except _Short as short:
            if want >= size:
                raise ValueError(f"{path}: truncated GGUF header (needs {short.needed} bytes,"
                                 f" the file has {size})") from None  # fmt: skip
            want = min(size, max(short.needed, 2 * want))


__all__ = ["GGUFFile", "GGUFTensorInfo", "parse_gguf"]
