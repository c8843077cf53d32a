"""A minimal read-only safetensors reader on numpy memmaps.

safetensors' own numpy backend cannot return bfloat16; this reader maps BF16 (and the fp8
types) through ml_dtypes, which jax already depends on. Format: u64 little-endian header
size N, N bytes of JSON {name: {dtype, shape, data_offsets: [begin, end]}}, then the data.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
    "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_,
}  # fmt: skip


def read_header(path: Path) -> tuple[dict[str, dict], int]:
    """({tensor name: {"dtype", "shape", "data_offsets"}}, byte offset of the data)."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path} is not a safetensors file (truncated header)")
        (size,) = struct.unpack("<Q", raw)
        try:
            header = json.loads(f.read(size))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path} is not a safetensors file: {e}") from None
    header.pop("__metadata__", None)
    return header, 8 + size


def load_tensors(path: Path) -> dict[str, np.ndarray]:
    """All tensors of one file as read-only numpy views of a memmap (no copy until used)."""
    header, data_start = read_header(path)
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=data_start)
    out = {}
    for name, info in header.items():
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']}")
        begin, end = info["data_offsets"]
        out[name] = data[begin:end].view(_DTYPES[info["dtype"]]).reshape(info["shape"])
    return out
