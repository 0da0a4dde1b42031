"""npz files whose large arrays never sit whole in a worker's memory: written from row pieces,
read as memory maps (a row-sparse key's table or optimizer state in a checkpoint).

They are ordinary npz files (`numpy.load` reads them): every array a stored, uncompressed .npy
member. `save` takes arrays and `Chunked` ones (their rows given piece by piece, in order);
`load` maps each stored member's bytes from the file, read-only, so reading a table takes only
the pages touched (clean page cache, which the kernel drops under a memory limit).
"""

from __future__ import annotations

import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
from numpy.lib import format as npy

#: Bytes of one piece when a table moves by rows (a pull, a write, a send): about 64 MiB.
PIECE_BYTES = 64 << 20
_SMALL = 1 << 20  # arrays below this are read into memory, not mapped


@dataclass(frozen=True)
class Chunked:
    """An array of `shape` given by consecutive row pieces: `pieces()` yields them in order."""

    shape: tuple[int, ...]
    pieces: Callable[[], Iterator[np.ndarray]]
    dtype: str = "float32"


def spans(rows: int, width: int, piece_bytes: int = PIECE_BYTES) -> Iterator[tuple[int, int]]:
    """[start, end) row ranges of at most `piece_bytes` of float32 rows of `width` values."""
    step = max(1, piece_bytes // max(1, 4 * width))
    for start in range(0, rows, step):
        yield start, min(rows, start + step)


def pieces(value: Any) -> Iterator[np.ndarray]:
    """Consecutive row pieces of an array (a memory map: read piece by piece) or a Chunked."""
    if isinstance(value, Chunked):
        yield from value.pieces()
        return
    width = int(np.prod(value.shape[1:], dtype=np.int64))
    for a, b in spans(int(value.shape[0]), width):
        yield np.asarray(value[a:b])


def save(path: str | Path, arrays: dict[str, Any]) -> None:
    """An npz file of `arrays` (name -> array or Chunked), each written as it comes."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED, allowZip64=True) as z:
        for name, value in arrays.items():
            with z.open(f"{name}.npy", "w", force_zip64=True) as f:
                if not isinstance(value, Chunked):
                    npy.write_array(f, np.asanyarray(value), allow_pickle=False)
                    continue
                dtype = np.dtype(value.dtype)
                npy.write_array_header_2_0(f, {"descr": npy.dtype_to_descr(dtype), "fortran_order": False,
                                               "shape": tuple(value.shape)})
                rows = 0
                for piece in value.pieces():
                    piece = np.ascontiguousarray(piece, dtype)
                    rows += len(piece)
                    f.write(memoryview(piece).cast("B"))
                if rows != value.shape[0]:
                    raise RuntimeError(f"{name}: {rows} rows written of {value.shape[0]}")


def load(path: str | Path) -> dict[str, np.ndarray]:
    """Every array of an npz file: large stored members as read-only memory maps, the rest read.
    A truncated or malformed file raises ValueError, OSError or zipfile.BadZipFile."""
    out: dict[str, np.ndarray] = {}
    with zipfile.ZipFile(path) as z, open(path, "rb") as raw:
        for info in z.infolist():
            name = info.filename.removesuffix(".npy")
            if info.compress_type != zipfile.ZIP_STORED:  # np.savez_compressed's: read whole
                with z.open(info) as f:
                    out[name] = npy.read_array(f, allow_pickle=False)
                continue
            raw.seek(info.header_offset)
            local = raw.read(30)
            if len(local) < 30 or local[:4] != b"PK\x03\x04":
                raise ValueError(f"member {info.filename} has no local header")
            name_len, extra_len = struct.unpack("<HH", local[26:30])
            raw.seek(info.header_offset + 30 + name_len + extra_len)
            version = npy.read_magic(raw)
            read_header = npy.read_array_header_1_0 if version == (1, 0) else npy.read_array_header_2_0
            shape, fortran, dtype = read_header(raw)
            if dtype.hasobject:
                raise ValueError(f"member {info.filename} holds Python objects")
            count = int(np.prod(shape, dtype=np.int64))
            order = "F" if fortran else "C"
            if count * dtype.itemsize < _SMALL:
                data = np.fromfile(raw, dtype, count)
                if len(data) != count:
                    raise ValueError(f"member {info.filename} is truncated")
                out[name] = data.reshape(shape, order=order)
            else:
                out[name] = np.memmap(path, dtype, "r", offset=raw.tell(), shape=shape, order=order)
    return out
