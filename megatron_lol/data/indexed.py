"""Megatron indexed datasets (.bin/.idx), written and merged in bounded memory.

The format is megatron-core's ``IndexedDataset`` (``MMIDIDX``):

    .idx = b"MMIDIDX\\x00\\x00" | u64 version (1) | u8 dtype code
           | u64 sequence_count | u64 document_count
           | int32 sequence_lengths[sequence_count]
           | int64 sequence_pointers[sequence_count]   (byte offsets into .bin)
           | int64 document_indices[document_count]    (0, then the end of each document)
    .bin = the tokens of every sequence, back to back, in the index dtype

``IndexedDatasetBuilder`` keeps the lengths in Python lists until ``finalize``;
``StreamingIndexWriter`` appends each document's length to a side file instead
(4 bytes per document on disk, nothing in RAM) and writes the .idx from it in
fixed-size chunks, byte-identical to what the builder writes for the same
documents (one sequence per document, no multimodal modes).

Outputs are written under temporary names and renamed only when complete:
the .bin first, then the .idx, so a .idx never exists without its full .bin.
"""

from __future__ import annotations

import os
import shutil
import socket
import struct

import numpy as np

from megatron_lol.errors import CliError
from megatron_lol.process_guard import pid_alive

INDEX_HEADER = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
# megatron.core.datasets.indexed_dataset.DType codes
DTYPE_CODES = {
    np.uint8: 1,
    np.int8: 2,
    np.int16: 3,
    np.int32: 4,
    np.int64: 5,
    np.float64: 6,
    np.float32: 7,
    np.uint16: 8,
}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}
CHUNK = 1 << 20  # entries per chunk when streaming index arrays


def optimal_dtype(vocab_size: int | None):
    """megatron-core's DType.optimal_dtype: uint16 below 65,500 ids, else int32."""
    if vocab_size is not None and vocab_size < 65500:
        return np.uint16
    return np.int32


def tmp_name(path: str) -> str:
    """Where ``path`` is written before it is renamed into place: ``{path}.tmp-{pid}-{host}``."""
    return f"{path}.tmp-{os.getpid()}-{socket.gethostname()}"


def remove_stale_tmp(path: str) -> list:
    """Remove ``{path}.tmp-*`` files left by dead processes of this host (``kill -9``, OOM);
    returns the removed names. Files of live processes and of other hosts are kept."""
    directory = os.path.dirname(os.path.abspath(path))
    stem = os.path.basename(path) + ".tmp-"
    host = socket.gethostname()
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(stem):
            continue
        pid_text, _, owner = name[len(stem) :].partition("-")
        if not pid_text.isdigit() or (owner and owner != host) or pid_alive(int(pid_text)):
            continue
        try:
            os.unlink(os.path.join(directory, name))
            removed.append(os.path.join(directory, name))
        except OSError:
            pass
    return removed


class IndexHeader:
    """Parsed .idx header with the file offsets of its three arrays."""

    def __init__(self, idx_path: str):
        self.path = idx_path
        with open(idx_path, "rb") as f:
            head = f.read(len(INDEX_HEADER) + 8 + 1 + 8 + 8)
        if len(head) < 34 or head[: len(INDEX_HEADER)] != INDEX_HEADER:
            raise ValueError(f"{idx_path}: not a Megatron MMIDIDX index")
        (version,) = struct.unpack("<Q", head[9:17])
        if version != INDEX_VERSION:
            raise ValueError(f"{idx_path}: unsupported index version {version}")
        code = head[17]
        if code not in CODE_DTYPES:
            raise ValueError(f"{idx_path}: unknown dtype code {code}")
        self.dtype = CODE_DTYPES[code]
        self.itemsize = np.dtype(self.dtype).itemsize
        self.sequence_count, self.document_count = struct.unpack("<QQ", head[18:34])
        self.lengths_offset = 34
        self.pointers_offset = self.lengths_offset + 4 * self.sequence_count
        self.doc_offset = self.pointers_offset + 8 * self.sequence_count
        self.end_offset = self.doc_offset + 8 * self.document_count
        size = os.path.getsize(idx_path)
        if size < self.end_offset:
            raise ValueError(f"{idx_path}: truncated index ({size} < {self.end_offset} bytes)")

    def iter_array(self, which: str):
        """Yield chunks of 'lengths' (int32) or 'documents' (int64) without loading all."""
        if which == "lengths":
            offset, count, dt = self.lengths_offset, self.sequence_count, np.int32
        elif which == "documents":
            offset, count, dt = self.doc_offset, self.document_count, np.int64
        else:
            raise KeyError(which)
        with open(self.path, "rb") as f:
            f.seek(offset)
            left = count
            while left:
                n = min(left, CHUNK)
                arr = np.fromfile(f, dtype=dt, count=n)
                if arr.size != n:
                    raise ValueError(f"{self.path}: truncated index")
                left -= n
                yield arr


def _write_header(f, dtype, sequence_count: int, document_count: int) -> None:
    f.write(INDEX_HEADER)
    f.write(struct.pack("<Q", INDEX_VERSION))
    f.write(struct.pack("<B", DTYPE_CODES[dtype]))
    f.write(struct.pack("<Q", sequence_count))
    f.write(struct.pack("<Q", document_count))


def _write_pointers(f, length_chunks, itemsize: int) -> None:
    running = np.int64(0)
    for lengths in length_chunks:
        ptr = np.empty(lengths.size, dtype=np.int64)
        if lengths.size:
            ptr[0] = 0
            np.cumsum(lengths[:-1], dtype=np.int64, out=ptr[1:])
            ptr *= itemsize
            ptr += running
            running = ptr[-1] + np.int64(lengths[-1]) * itemsize
        f.write(ptr.tobytes())


def _iter_file_chunks(path: str, dt, count: int):
    with open(path, "rb") as f:
        left = count
        while left:
            n = min(left, CHUNK)
            arr = np.fromfile(f, dtype=dt, count=n)
            if arr.size != n:
                raise IOError(f"{path}: short read")
            left -= n
            yield arr


class StreamingIndexWriter:
    """Write one dataset (prefix.bin / prefix.idx), one sequence per document.

    Memory use is independent of the number of documents: lengths go to a side
    file as they arrive, and the index is assembled from it in chunks.
    """

    def __init__(self, prefix: str, dtype):
        self.prefix = prefix
        self.dtype = dtype
        self.bin_path, self.idx_path = prefix + ".bin", prefix + ".idx"
        self._bin_tmp = tmp_name(self.bin_path)
        self._idx_tmp = tmp_name(self.idx_path)
        self._len_tmp = tmp_name(prefix + ".lengths")
        self._bin = open(self._bin_tmp, "wb")
        self._len = open(self._len_tmp, "wb")
        self.documents = 0
        self.tokens = 0
        self.closed = False

    def add_documents(self, data: bytes, lengths: np.ndarray) -> None:
        """Append documents: ``data`` is their tokens in self.dtype, ``lengths`` int32."""
        lengths = np.ascontiguousarray(lengths, dtype=np.int32)
        self._bin.write(data)
        self._len.write(lengths.tobytes())
        self.documents += int(lengths.size)
        self.tokens += int(lengths.sum(dtype=np.int64))

    def add_document(self, tokens) -> None:
        arr = np.asarray(tokens, dtype=self.dtype)
        self.add_documents(arr.tobytes(), np.array([arr.size], dtype=np.int32))

    def finalize(self) -> None:
        """Write the index, then rename .bin and .idx into place (in that order)."""
        self._bin.close()
        self._len.close()
        n = self.documents
        itemsize = np.dtype(self.dtype).itemsize
        with open(self._idx_tmp, "wb") as f:
            _write_header(f, self.dtype, n, n + 1)
            with open(self._len_tmp, "rb") as lf:
                shutil.copyfileobj(lf, f, 1 << 22)
            _write_pointers(f, _iter_file_chunks(self._len_tmp, np.int32, n), itemsize)
            for start in range(0, n + 1, CHUNK):
                f.write(np.arange(start, min(n + 1, start + CHUNK), dtype=np.int64).tobytes())
        os.unlink(self._len_tmp)
        commit(self._bin_tmp, self.bin_path, self._idx_tmp, self.idx_path)
        self.closed = True

    def abort(self) -> None:
        if self.closed:
            return
        for fh in (self._bin, self._len):
            try:
                fh.close()
            except OSError:
                pass
        for p in (self._bin_tmp, self._idx_tmp, self._len_tmp):
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
        self.closed = True


def commit(bin_tmp: str, bin_path: str, idx_tmp: str, idx_path: str) -> None:
    """Move a finished pair into place; an old .idx goes first so no stale pair mixes."""
    if os.path.exists(idx_path):
        os.unlink(idx_path)
    os.replace(bin_tmp, bin_path)
    os.replace(idx_tmp, idx_path)


def merge_datasets(prefixes: list, output_prefix: str) -> dict:
    """Concatenate datasets in order into output_prefix.{bin,idx}, streaming.

    Byte-identical to IndexedDatasetBuilder.add_index over the same prefixes.
    """
    if not prefixes:
        raise ValueError("nothing to merge")
    headers = []
    for p in prefixes:
        for ext in (".bin", ".idx"):
            if not os.path.isfile(p + ext):
                raise ValueError(f"missing {p + ext}")
        h = IndexHeader(p + ".idx")
        if headers and h.dtype != headers[0].dtype:
            raise ValueError(
                f"{p}.idx: dtype {np.dtype(h.dtype).name} differs from "
                f"{np.dtype(headers[0].dtype).name} of {prefixes[0]}.idx"
            )
        expected = sum(int(a.sum(dtype=np.int64)) for a in h.iter_array("lengths")) * h.itemsize
        actual = os.path.getsize(p + ".bin")
        if expected != actual:
            raise ValueError(f"{p}.bin: {actual} bytes, its index describes {expected}")
        headers.append(h)
    dtype = headers[0].dtype
    itemsize = headers[0].itemsize
    seqs = sum(h.sequence_count for h in headers)
    docs = 1 + sum(h.document_count - 1 for h in headers)
    bin_path, idx_path = output_prefix + ".bin", output_prefix + ".idx"
    bin_tmp, idx_tmp = tmp_name(bin_path), tmp_name(idx_path)
    try:
        with open(bin_tmp, "wb") as out:
            for p in prefixes:
                with open(p + ".bin", "rb") as f:
                    shutil.copyfileobj(f, out, 1 << 22)
        with open(idx_tmp, "wb") as f:
            _write_header(f, dtype, seqs, docs)
            for h in headers:
                for chunk in h.iter_array("lengths"):
                    f.write(chunk.tobytes())
            _write_pointers(f, (c for h in headers for c in h.iter_array("lengths")), itemsize)
            f.write(np.zeros(1, dtype=np.int64).tobytes())
            offset = 0
            for h in headers:
                first = True
                for chunk in h.iter_array("documents"):
                    if first:
                        chunk = chunk[1:]
                        first = False
                    f.write((chunk + offset).tobytes())
                offset += h.sequence_count
        commit(bin_tmp, bin_path, idx_tmp, idx_path)
    except BaseException:
        for p in (bin_tmp, idx_tmp):
            if os.path.exists(p):
                os.unlink(p)
        raise
    return {
        "datasets": len(prefixes),
        "sequences": seqs,
        "documents": docs - 1,
        "bytes": os.path.getsize(bin_path),
        "dtype": np.dtype(dtype).name,
    }


# -- checks before training ------------------------------------------------------


class DatasetError(CliError, ValueError):
    """A dataset file is unusable; the message names the file and what is wrong (one line)."""


def _memmap(path: str, dtype, offset: int, count: int) -> np.ndarray:
    if count == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=(count,))


def validate_dataset(prefix: str) -> IndexHeader:
    """Check ``prefix.idx`` against itself and ``prefix.bin`` before megatron-core reads them.

    A truncated or foreign file otherwise surfaces as an IndexError, a NumPy
    error or a hang deep inside the dataset code. Checked, in bounded memory:
    the header, the index's size, sequence lengths >= 0, every sequence pointer
    continuing the previous sequence, document indices increasing from 0 to the
    sequence count, and the ``.bin`` holding exactly the bytes the index
    describes. Returns the parsed header.
    """
    idx_path, bin_path = prefix + ".idx", prefix + ".bin"
    for path in (bin_path, idx_path):
        if not os.path.isfile(path):
            raise DatasetError(f"dataset {prefix}: missing {path}")
    try:
        h = IndexHeader(idx_path)
    except ValueError as err:
        raise DatasetError(str(err)) from None
    if h.sequence_count == 0 or h.document_count <= 1:
        raise DatasetError(f"{idx_path}: the dataset holds no documents")
    expected_end, ptr_end = 0, 0
    lengths = _memmap(idx_path, np.int32, h.lengths_offset, h.sequence_count)
    pointers = _memmap(idx_path, np.int64, h.pointers_offset, h.sequence_count)
    for start in range(0, h.sequence_count, CHUNK):
        ln = np.asarray(lengths[start : start + CHUNK], dtype=np.int64)
        pt = np.asarray(pointers[start : start + CHUNK])
        if (ln < 0).any():
            i = start + int(np.flatnonzero(ln < 0)[0])
            raise DatasetError(f"{idx_path}: sequence {i} has a negative length ({int(lengths[i])}): corrupt index")
        want = np.empty_like(pt)
        want[0] = expected_end
        np.cumsum(ln[:-1] * h.itemsize, out=want[1:])
        want[1:] += expected_end
        if (pt != want).any():
            i = int(np.flatnonzero(pt != want)[0])
            raise DatasetError(
                f"{idx_path}: sequence {start + i} starts at byte {int(pt[i])}, expected "
                f"{int(want[i])} (after the previous sequence): corrupt index"
            )
        expected_end = int(want[-1] + ln[-1] * h.itemsize)
        ptr_end = expected_end
    docs = _memmap(idx_path, np.int64, h.doc_offset, h.document_count)
    previous = -1
    for start in range(0, h.document_count, CHUNK):
        d = np.asarray(docs[start : start + CHUNK])
        if start == 0 and d[0] != 0:
            raise DatasetError(f"{idx_path}: document indices start at {int(d[0])}, not 0: corrupt index")
        steps = np.diff(np.concatenate([[previous], d]))
        if (steps < 0).any():
            raise DatasetError(f"{idx_path}: document indices decrease: corrupt index")
        previous = int(d[-1])
    if previous != h.sequence_count:
        raise DatasetError(
            f"{idx_path}: the last document ends at sequence {previous}, the index holds "
            f"{h.sequence_count}: corrupt index"
        )
    size = os.path.getsize(bin_path)
    if size != ptr_end:
        what = "truncated" if size < ptr_end else "longer than its index"
        raise DatasetError(
            f"{bin_path}: {what} ({size} bytes, {idx_path} describes {ptr_end}): "
            f"re-run preprocess, or pair it with its own .idx"
        )
    return h


def sequence_lengths(h: IndexHeader) -> np.ndarray:
    """The int32 sequence lengths of a validated index (memory-mapped)."""
    return _memmap(h.path, np.int32, h.lengths_offset, h.sequence_count)


def scan_token_ids(prefix: str, h: IndexHeader, limit: int | None = None, part: tuple = (0, 1)) -> tuple:
    """``(max_id, first)`` over part ``part = (i, n)`` of ``prefix.bin`` (every n-th chunk from the
    i-th, so n processes share one scan): the largest token id, and with ``limit`` the
    ``(token index, document, position)`` of the first id >= limit (None when there is none)."""
    size = os.path.getsize(prefix + ".bin") // h.itemsize
    data = np.memmap(prefix + ".bin", dtype=h.dtype, mode="r", shape=(size,)) if size else None
    best, first = -1, None
    step = 16 * CHUNK
    index, parts = part
    for k, start in enumerate(range(0, size, step)):
        if k % parts != index:
            continue
        chunk = np.asarray(data[start : start + step])
        top = int(chunk.max())
        best = max(best, top)
        if limit is not None and first is None and top >= limit:
            token = start + int(np.flatnonzero(chunk >= limit)[0])
            pointers = _memmap(h.path, np.int64, h.pointers_offset, h.sequence_count)
            seq = int(np.searchsorted(pointers, token * h.itemsize, side="right")) - 1
            first = (token, seq, token - int(pointers[seq]) // h.itemsize)
    return best, first
