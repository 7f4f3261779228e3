"""Chunked ``.npy`` I/O that keeps memory bounded: a hashing streaming writer and
page-cache-friendly chunk readers for memory-mapped arrays."""

from __future__ import annotations

import hashlib
import io
import math
import os
import threading
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, BinaryIO, Literal

import numpy as np

#: Bytes hashed per read when checksumming a file.
_HASH_BLOCK = 8 << 20


@dataclass(frozen=True)
class FileRecord:
    """What a manifest records of one ``.npy`` file."""

    #: Path relative to the partition root, with ``/`` separators.
    path: str
    #: numpy dtype name, e.g. ``int64``.
    dtype: str
    #: Array shape.
    shape: tuple[int, ...]
    #: Size of the whole file in bytes (header included).
    size_bytes: int
    #: Hex SHA-256 of the whole file.
    sha256: str

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "shape": list(self.shape)}

    @staticmethod
    def from_json(obj: dict[str, Any]) -> FileRecord:
        return FileRecord(path=str(obj["path"]), dtype=str(obj["dtype"]),
                          shape=tuple(int(s) for s in obj["shape"]), size_bytes=int(obj["size_bytes"]),
                          sha256=str(obj["sha256"]))


class NpyWriter:
    """Write a C-ordered ``.npy`` file in chunks along axis 0, hashing as it goes.

    >>> w = NpyWriter(root, "part-0/x.npy", np.float32, (n, f))
    >>> for chunk in chunks: w.append(chunk)
    >>> record = w.close()
    """

    def __init__(
        self, root: Path, relpath: str, dtype: np.dtype | type, shape: tuple[int, ...]
    ) -> None:
        self._dtype = np.dtype(dtype).newbyteorder("<")
        self._shape = tuple(int(s) for s in shape)
        self._row_items = int(np.prod(self._shape[1:], dtype=np.int64)) if self._shape else 1
        self._rows_expected = self._shape[0] if self._shape else 1
        self._rows = 0
        self._relpath = relpath
        self._hash = hashlib.sha256()
        self._size = 0
        path = root / relpath
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file: BinaryIO = open(path, "wb")  # noqa: SIM115 - closed in close()
        header = io.BytesIO()
        np.lib.format.write_array_header_1_0(header, {"descr": np.lib.format.dtype_to_descr(self._dtype),
                                                      "fortran_order": False, "shape": self._shape})
        self._write(header.getvalue())

    def _write(self, data: bytes | memoryview) -> None:
        self._file.write(data)
        self._hash.update(data)
        self._size += len(data)

    def append(self, chunk: np.ndarray) -> None:
        """Append rows (or, for a 0-d/1-d file, elements) to the file."""
        arr = np.ascontiguousarray(chunk, dtype=self._dtype)
        rows = arr.shape[0] if arr.ndim else 1
        if arr.size != rows * self._row_items:
            raise ValueError(
                f"{self._relpath}: expected rows of {self._row_items} items, got shape {arr.shape}"
            )
        if self._rows + rows > self._rows_expected:
            raise ValueError(
                f"{self._relpath}: expected {self._rows_expected} rows, "
                f"got at least {self._rows + rows}"
            )
        self._rows += rows
        if arr.size:
            self._write(arr.data.cast("B"))

    def close(self) -> FileRecord:
        """Finish the file and return its record; fails if rows are missing."""
        self._file.close()
        if self._rows != self._rows_expected:
            raise ValueError(
                f"{self._relpath}: expected {self._rows_expected} rows, wrote {self._rows}"
            )
        return FileRecord(self._relpath, self._dtype.name, self._shape, self._size,
                          self._hash.hexdigest())


def save_npy(root: Path, relpath: str, array: np.ndarray, chunk_rows: int = 1 << 22) -> FileRecord:
    """Write ``array`` to ``root/relpath`` and return its record."""
    arr = np.asarray(array)
    writer = NpyWriter(root, relpath, arr.dtype, arr.shape)
    if arr.ndim == 0:
        writer.append(arr.reshape(1))
    else:
        for start in range(0, max(arr.shape[0], 1), chunk_rows):
            writer.append(read_rows(arr, start, min(start + chunk_rows, arr.shape[0])))
    return writer.close()


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file, read in blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


#: NumPy parses a ``.npy`` header with ``ast.literal_eval``. CPython 3.11 keeps the AST
#: constructor's recursion depth per interpreter, not per thread, so headers parsed in
#: several threads at once fail now and then with "SystemError: AST constructor recursion
#: depth mismatch" (python/cpython#106905); ``check_files`` reads headers in a thread pool
#: and servers load partitions in threads, so every header goes through this lock.
_HEADER_LOCK = threading.Lock()


def read_npy_header(path: Path) -> tuple[np.dtype, tuple[int, ...], bool, int]:
    """Return ``(dtype, shape, fortran_order, data_offset)`` of a ``.npy`` file (thread-safe)."""
    with open(path, "rb") as f, _HEADER_LOCK:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
        else:
            raise ValueError(f"unsupported .npy version {version}")
        return dtype, tuple(shape), fortran, f.tell()


def load_npy(path: Path, mmap: bool = True) -> np.ndarray:
    """``np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)`` of a ``.npy``
    file, with its header parsed under the header lock (thread-safe, see above)."""
    dtype, shape, fortran, offset = read_npy_header(path)
    if dtype.hasobject:
        raise ValueError(f"{path}: expected an array of numbers, got dtype {dtype} (object arrays "
                         "need pickle, which is refused)")
    order: Literal["C", "F"] = "F" if fortran else "C"
    count = math.prod(shape)
    if count == 0:
        empty = np.empty(shape, dtype=dtype, order=order)
        empty.flags.writeable = not mmap
        return empty
    if mmap:
        return np.memmap(path, dtype=dtype, mode="r", shape=shape, order=order, offset=offset)
    with open(path, "rb") as f:
        f.seek(offset)
        flat = np.fromfile(f, dtype=dtype, count=count)
    if flat.size != count:
        raise ValueError(f"{path}: expected {count} values of {dtype} after the header, "
                         f"got {flat.size} (truncated file)")
    return flat.reshape(shape, order=order)


def _memmap_source(arr: np.ndarray) -> tuple[str, int] | None:
    """``(filename, data offset)`` of a whole-file C-contiguous memmap, else None.

    Views of a memmap (slices) keep their parent's ``offset``, so only arrays whose
    base is the mapping itself qualify.
    """
    if (
        isinstance(arr, np.memmap)
        and arr.filename
        and arr.flags.c_contiguous
        and not isinstance(arr.base, np.ndarray)
    ):
        return str(arr.filename), int(arr.offset)
    return None


def read_flat(arr: np.ndarray, start: int, stop: int) -> np.ndarray:
    """Copy flat elements ``[start, stop)`` of C-contiguous ``arr`` into a new array.

    For a memory-mapped file this is a ``pread``, so the mapping's pages never count
    towards the process's resident memory.
    """
    src = _memmap_source(arr)
    count = stop - start
    if src is None:
        return np.array(arr.reshape(-1)[start:stop])
    filename, offset = src
    item = arr.dtype.itemsize
    out = np.empty(count, dtype=arr.dtype)
    fd = os.open(filename, os.O_RDONLY)
    try:
        view = out.data.cast("B")
        pos, done = offset + start * item, 0
        while done < count * item:
            n = os.preadv(fd, [view[done:]], pos + done)
            if n <= 0:
                raise OSError(f"{filename}: unexpected end of file")
            done += n
    finally:
        os.close(fd)
    return out


def read_rows(arr: np.ndarray, start: int, stop: int) -> np.ndarray:
    """Copy rows ``[start, stop)`` of ``arr`` (axis 0) into a new array."""
    if _memmap_source(arr) is None:
        return np.array(arr[start:stop])
    row = int(np.prod(arr.shape[1:], dtype=np.int64))
    return read_flat(arr, start * row, stop * row).reshape((stop - start, *arr.shape[1:]))


def iter_edge_chunks(
    edge_index: np.ndarray, chunk: int
) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """Yield ``(first_edge, src, dst)`` chunks of a ``[2, E]`` edge list."""
    num_edges = int(edge_index.shape[1])
    for start in range(0, num_edges, chunk):
        stop = min(start + chunk, num_edges)
        if _memmap_source(edge_index) is None:
            src, dst = edge_index[0, start:stop], edge_index[1, start:stop]
        else:
            src = read_flat(edge_index, start, stop)
            dst = read_flat(edge_index, num_edges + start, num_edges + stop)
        yield start, np.ascontiguousarray(src), np.ascontiguousarray(dst)


def iter_row_chunks(arr: np.ndarray, chunk: int) -> Iterator[tuple[int, np.ndarray]]:
    """Yield ``(first_row, rows)`` chunks of an array along axis 0."""
    for start in range(0, int(arr.shape[0]), chunk):
        yield start, read_rows(arr, start, min(start + chunk, int(arr.shape[0])))
