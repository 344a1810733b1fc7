"""Reading parts of safetensors files: each process of a sharded model reads only the rows of
each tensor that its shard holds.

A safetensors file is an 8-byte little-endian header length, a JSON header (each tensor's
dtype, shape and byte range in the data that follows) and the data, row-major. Rows
``a:b`` of a tensor are one contiguous byte range, so a shard (FSDP2 shards on dim 0) is
one read of exactly its bytes: ``read_rows`` seeks and reads, with no memory map, so what a
process reads is what its ``/proc/self/io`` counts. A file at a URL (``s3://...``) is read the
same way, each read a ranged request (``storage.open_ranges``), never a download of the whole
file. The files themselves are written by the ``safetensors`` package (``save_model``) or by
Hugging Face.
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any

import torch

from hasten.checkpoint import storage

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
}


def _read_exactly(f: Any, n: int) -> bytes:
    parts, left = [], n
    while left > 0:
        chunk = f.read(left)
        if not chunk:
            break
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


class SafetensorsFile:
    """The header of one safetensors file, and reads of rows of its tensors."""

    def __init__(self, path: str) -> None:
        self.path = path
        size = storage.getsize(path)
        with storage.open_ranges(path) as f:  # only the bytes asked for
            head = _read_exactly(f, 8)
            length = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if not 0 < length <= size - 8:
                raise ValueError(
                    f"{path!r} is not a safetensors file (its header length reads {length}, the file has {size} bytes)"
                )
            try:
                header = json.loads(_read_exactly(f, length))
            except ValueError as e:
                raise ValueError(f"{path!r} is not a safetensors file: its header is not JSON ({e})") from e
        #: the header's ``__metadata__`` as written (None where there is none), and as a dict
        self.raw_metadata: dict[str, str] | None = header.pop("__metadata__", None)
        self.metadata: dict[str, str] = self.raw_metadata or {}
        self.base = 8 + length
        self.entries: dict[str, dict[str, Any]] = header
        for name, e in header.items():
            begin, end = e.get("data_offsets", (0, -1))
            if e.get("dtype") not in _DTYPES or not 0 <= begin <= end or self.base + end > size:
                raise ValueError(
                    f"{path!r}: tensor {name!r} has dtype {e.get('dtype')!r} and bytes {begin}..{end} of a data "
                    "section "
                    f"of {size - self.base}: the file is cut short or not a safetensors file"
                )

    def table(self) -> dict[str, dict[str, Any]]:
        """Names -> shape and dtype, as ``weights.tensor_table`` gives them for a state dict."""
        return {
            n: {"shape": list(e["shape"]), "dtype": str(_DTYPES[e["dtype"]]).replace("torch.", "")}
            for n, e in self.entries.items()
        }

    def in_file_order(self, names: Any) -> list[str]:
        """``names`` (entries of this file) in the order their bytes lie in it."""
        return sorted(names, key=lambda n: self.entries[n]["data_offsets"][0])

    def read_all(self, f: Any) -> dict[str, torch.Tensor]:
        """Every tensor of the file, read from the open file ``f`` in file order (a URL's reads
        then follow one another), in the header's order."""
        read = {name: self.read_rows(f, name) for name in self.in_file_order(self.entries)}
        return {name: read[name] for name in self.entries}

    def read_rows(self, f: Any, name: str, rows: slice | None = None) -> torch.Tensor:
        """Tensor ``name``, or only its rows ``rows`` (a slice of dim 0 with a step of 1), from
        the open file ``f``."""
        e = self.entries[name]
        dtype, shape = _DTYPES[e["dtype"]], list(e["shape"])
        begin, end = e["data_offsets"]
        if rows is not None and shape:
            row = math.prod(shape[1:]) * dtype.itemsize
            start, stop, _ = rows.indices(shape[0])
            stop = max(stop, start)
            begin, end = begin + start * row, begin + stop * row
            shape[0] = stop - start
        buf = bytearray(end - begin)
        f.seek(self.base + begin)
        view, got = memoryview(buf), 0
        while got < len(buf):
            n = f.readinto(view[got:])
            if not n:
                raise ValueError(f"{self.path!r}: tensor {name!r} is cut short ({got} of {len(buf)} bytes)")
            got += n
        if not buf:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(buf, dtype=dtype).reshape(shape)
