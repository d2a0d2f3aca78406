"""Input discovery, deterministic sharding and chunked reading for preprocess.

Formats: ``.jsonl``/``.json`` (one JSON object per line), the same with
``.gz`` or ``.zst``, ``.parquet`` (a string column per key) and ``.txt`` (the
whole file is one document).

Sharding: the inputs, in sorted order, are laid end to end on one axis of
input bytes. Shard I of N owns the bytes [I*T/N, (I+1)*T/N). A plain JSONL
line belongs to the shard holding its first byte; compressed files and .txt
files are indivisible and belong to the shard holding their first byte; a
parquet row group likewise (weighted by its compressed size). So the shards
are contiguous runs of the input order and concatenating their outputs
reproduces a single run exactly.
"""

from __future__ import annotations

import glob
import io
import os
from dataclasses import dataclass

JSONL_EXT = (".jsonl", ".json", ".ndjson")
SUPPORTED = tuple(
    [e for e in JSONL_EXT] + [e + c for e in JSONL_EXT for c in (".gz", ".zst", ".zstd")] + [".parquet", ".txt"]
)
BLOCK = 1 << 20  # bytes per task for JSONL input


class InputError(ValueError):
    """A user-facing problem with the input (message is one line)."""


def file_kind(path: str) -> str:
    low = path.lower()
    for c in (".gz", ".zst", ".zstd"):
        if low.endswith(c) and low[: -len(c)].endswith(JSONL_EXT):
            return "jsonl" + (".gz" if c == ".gz" else ".zst")
    if low.endswith(JSONL_EXT):
        return "jsonl"
    if low.endswith(".parquet"):
        return "parquet"
    if low.endswith(".txt"):
        return "txt"
    raise InputError(f"{path}: unsupported input format (expected one of {', '.join(SUPPORTED)})")


def expand_inputs(spec) -> list:
    """--input: files, directories (searched recursively) or globs; sorted, deduplicated."""
    specs = [spec] if isinstance(spec, str) else list(spec)
    out: list = []
    for s in specs:
        for part in s.split(","):
            part = part.strip()
            if not part:
                continue
            if os.path.isdir(part):
                found = []
                for root, _dirs, files in os.walk(part):
                    for name in files:
                        if name.lower().endswith(SUPPORTED):
                            found.append(os.path.join(root, name))
                if not found:
                    raise InputError(f"{part}: directory has no input files ({', '.join(SUPPORTED)})")
                out.extend(sorted(found))
            elif os.path.isfile(part):
                file_kind(part)
                out.append(part)
            elif glob.has_magic(part):
                found = sorted(p for p in glob.glob(part, recursive=True) if os.path.isfile(p))
                if not found:
                    raise InputError(f"{part}: no file matches")
                for p in found:
                    file_kind(p)
                out.extend(found)
            else:
                raise InputError(f"{part}: no such file or directory")
    seen, result = set(), []
    for p in out:
        if p not in seen:
            seen.add(p)
            result.append(p)
    if not result:
        raise InputError("no input files")
    return result


@dataclass
class Piece:
    file_index: int
    path: str
    kind: str
    start: int  # global byte position of the piece
    size: int
    row_group: int = -1  # parquet
    local_lo: int = 0  # plain jsonl: local byte range [lo, hi)
    local_hi: int = 0


def plan_pieces(paths: list) -> tuple:
    pieces, pos = [], 0
    for i, p in enumerate(paths):
        kind = file_kind(p)
        size = os.path.getsize(p)
        if kind == "parquet":
            import pyarrow.parquet as pq

            try:
                meta = pq.ParquetFile(p).metadata
            except Exception as err:  # noqa: BLE001
                raise InputError(f"{p}: not a readable parquet file ({err})") from None
            for rg in range(meta.num_row_groups):
                rgm = meta.row_group(rg)
                w = max(1, sum(rgm.column(c).total_compressed_size for c in range(rgm.num_columns)))
                pieces.append(Piece(i, p, kind, pos, w, row_group=rg))
                pos += w
        else:
            pieces.append(Piece(i, p, kind, pos, size, local_lo=0, local_hi=size))
            pos += size
    return pieces, pos


def shard_pieces(paths: list, shard: int = 0, num_shards: int = 1) -> list:
    """The pieces of shard ``shard`` of ``num_shards`` (see module doc)."""
    pieces, total = plan_pieces(paths)
    if num_shards == 1:
        return pieces
    lo = shard * total // num_shards
    hi = (shard + 1) * total // num_shards
    mine = []
    for pc in pieces:
        if pc.kind == "jsonl":
            a, b = max(lo, pc.start), min(hi, pc.start + pc.size)
            if a < b:
                mine.append(
                    Piece(pc.file_index, pc.path, pc.kind, a, b - a, local_lo=a - pc.start, local_hi=b - pc.start)
                )
        elif lo <= pc.start < hi:
            mine.append(pc)
    return mine


# -- tasks ----------------------------------------------------------------------
# A task is a tuple sent to a worker:
#   ("lines", file_index, byte_offset, line_base, data)  data: bytes of whole lines
#       line_base: 1-based line number of the first line, or None when the shard
#       starts mid-file (computed on demand for error messages)
#   ("rows", file_index, row_base, {key: [str|None]})    parquet rows
#   ("txt", file_index, data)                             one document


class ZstdFrames(io.RawIOBase):
    """The decompressed bytes of a ``.zst`` file, frame after frame, that fail on a cut file.

    ``zstandard``'s ``stream_reader`` returns end-of-file when the input ends in
    the middle of a frame, so a truncated download would look like a shorter
    corpus. Here a file must end exactly at the end of a frame: otherwise reading
    raises :class:`InputError` naming the file.
    """

    def __init__(self, path: str):
        import zstandard

        self.path = path
        self.fileobj = open(path, "rb")
        self._dctx = zstandard.ZstdDecompressor()
        self._frame = None  # decompressor of the frame in progress
        self._pending = b""
        self._pos = 0
        self._done = False

    def readable(self) -> bool:
        return True

    def _fill(self) -> None:
        while self._pos >= len(self._pending) and not self._done:
            raw = self.fileobj.read(256 << 10)
            if not raw:
                if self._frame is not None:
                    raise InputError(f"{self.path}: truncated zstd file (it ends inside a frame)")
                self._done = True
                return
            parts = []
            while raw:
                if self._frame is None:
                    self._frame = self._dctx.decompressobj()
                parts.append(self._frame.decompress(raw))
                if self._frame.eof:
                    raw = self._frame.unused_data
                    self._frame = None
                else:
                    raw = b""
            self._pending, self._pos = b"".join(parts), 0

    def readinto(self, buffer) -> int:
        self._fill()
        n = min(len(buffer), len(self._pending) - self._pos)
        buffer[:n] = self._pending[self._pos : self._pos + n]
        self._pos += n
        return n

    def close(self) -> None:
        self.fileobj.close()
        super().close()


def _open_stream(path: str, kind: str):
    if kind == "jsonl.gz":
        import gzip

        return gzip.open(path, "rb")
    if kind == "jsonl.zst":
        return io.BufferedReader(ZstdFrames(path), 1 << 20)
    return open(path, "rb")


def iter_tasks(pieces: list, keys: list, progress=None):
    """Yield tasks in input order; ``progress(nbytes)`` is called with input bytes consumed."""
    for pc in pieces:
        if pc.kind == "txt":
            with open(pc.path, "rb") as f:
                data = f.read()
            if progress:
                progress(pc.size)
            yield ("txt", pc.file_index, data)
        elif pc.kind == "parquet":
            yield from _parquet_tasks(pc, keys, progress)
        elif pc.kind == "jsonl":
            yield from _plain_jsonl_tasks(pc, progress)
        else:
            yield from _stream_jsonl_tasks(pc, progress)


def _plain_jsonl_tasks(pc: Piece, progress):
    a, b = pc.local_lo, pc.local_hi
    with open(pc.path, "rb", buffering=0) as raw:
        f = io.BufferedReader(raw, 1 << 20)
        line_base = 1
        if a > 0:
            f.seek(a - 1)
            if f.read(1) != b"\n":
                f.readline()  # the line in progress belongs to the previous shard
            line_base = None
        pos = f.tell()
        consumed = a
        while pos < b:
            block = f.read(BLOCK)
            if not block:
                break
            if not block.endswith(b"\n"):
                block += f.readline()
            if pos + len(block) > b:
                # keep lines that start before b: cut after the newline at/after b-1
                cut = block.find(b"\n", b - 1 - pos)
                if cut != -1:
                    block = block[: cut + 1]
            yield ("lines", pc.file_index, pos, line_base, block)
            if line_base is not None:
                line_base += block.count(b"\n")
            pos += len(block)
            if progress:
                done = min(pos, b)
                progress(done - consumed)
                consumed = done
        if progress and consumed < b:
            progress(b - consumed)


def _stream_jsonl_tasks(pc: Piece, progress):
    try:
        f = _open_stream(pc.path, pc.kind)
    except ImportError as err:
        raise InputError(f"{pc.path}: {err}") from None
    with f:
        raw = getattr(f, "fileobj", None) or getattr(getattr(f, "raw", None), "fileobj", None)
        pos, line_base = 0, 1
        last_raw = 0
        while True:
            try:
                block = f.read(BLOCK)
                if block and not block.endswith(b"\n"):
                    block += f.readline()
            except InputError:
                raise
            except Exception as err:  # noqa: BLE001 - gzip/zstd raise various types
                raise InputError(f"{pc.path}: cannot decompress ({err})") from None
            if not block:
                break
            yield ("lines", pc.file_index, pos, line_base, block)
            line_base += block.count(b"\n")
            pos += len(block)
            if progress and raw is not None:
                now = raw.tell()
                progress(now - last_raw)
                last_raw = now
        if progress:
            progress(max(0, pc.size - last_raw))


def check_parquet_columns(paths: list, keys: list) -> None:
    """Every parquet input has a string column per key: read from each file's footer (no rows), so a
    file without ``text`` stops every shard of an array at its start -- and a submitting host before
    anything is queued -- not only the shard that reaches that file."""
    import pyarrow.parquet as pq

    for p in paths:
        if file_kind(p) != "parquet":
            continue
        try:
            schema = pq.read_schema(p)
        except Exception as err:  # noqa: BLE001
            raise InputError(f"{p}: not a readable parquet file ({err})") from None
        _check_parquet_schema(p, schema, keys)


def _check_parquet_schema(path: str, schema, keys: list) -> None:
    import pyarrow as pa

    for k in keys:
        if k not in schema.names:
            raise InputError(f"{path}: no column {k!r} (columns: {', '.join(schema.names)})")
        t = schema.field(k).type
        if not (pa.types.is_string(t) or pa.types.is_large_string(t)):
            raise InputError(f"{path}: column {k!r} has type {t}, expected a string column")


def _parquet_tasks(pc: Piece, keys: list, progress):
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(pc.path)
    _check_parquet_schema(pc.path, pf.schema_arrow, keys)
    row_base = sum(pf.metadata.row_group(i).num_rows for i in range(pc.row_group)) + 1
    table = pf.read_row_group(pc.row_group, columns=keys)
    n = table.num_rows
    # about BLOCK bytes of text per task
    nbytes = max(1, sum(table.column(k).nbytes for k in keys))
    step = max(1, int(n * BLOCK / nbytes))
    for start in range(0, n, step):
        part = table.slice(start, step)
        yield ("rows", pc.file_index, row_base + start, {k: part.column(k).to_pylist() for k in keys})
    if progress:
        progress(pc.size)


def line_number(path: str, byte_offset: int, line_base, index_in_block: int) -> int:
    """1-based line number of the index_in_block-th line of a block at byte_offset."""
    if line_base is None:
        count = 0
        with open(path, "rb") as f:
            left = byte_offset
            while left:
                buf = f.read(min(left, 1 << 22))
                if not buf:
                    break
                count += buf.count(b"\n")
                left -= len(buf)
        line_base = count + 1
    return line_base + index_in_block
