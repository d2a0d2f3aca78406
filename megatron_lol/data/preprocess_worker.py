"""What a ``megatron-lol preprocess`` worker does with one task: parse, tokenize and pack its documents.

The main process (:mod:`.preprocess`) reads the corpus in tasks (a block of
JSON lines, a parquet row group, a text file) and hands each to a worker
process (or runs it in-process with one worker); a worker keeps its tokenizer
in module state (:func:`_worker_init`) and returns, per key, the packed token
bytes and document lengths, the lines it could not use with the reason, or the
first bad line when bad lines stop the run. Kept apart from the driver so each
side can be read alone: nothing here knows about output files or progress.
"""

from __future__ import annotations

import json
import signal

import numpy as np

_W: dict = {}


def _worker_init(
    tok_kwargs: dict, keys: list, append_eod: bool, skip_bad: bool, dtype_name: str, parent_pid: int | None = None
) -> None:
    from megatron_lol.data.tokenizers import build_tokenizer

    if parent_pid is not None:  # a worker process: exit with the main process, even after kill -9
        from megatron_lol.process_guard import die_with_parent

        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the main process's unwinding handler
        die_with_parent(parent_pid)

    _W["tok"] = build_tokenizer(**tok_kwargs)
    _W["keys"] = keys
    _W["eod"] = _W["tok"].eod if append_eod else None
    _W["skip"] = skip_bad
    _W["dtype"] = np.dtype(dtype_name)


def _encode_texts(texts: list) -> list:
    tok = _W["tok"]
    try:
        return tok.encode_batch(texts)
    except Exception:  # noqa: BLE001 - find the document that fails
        out = []
        for t in texts:
            try:
                out.append(tok.tokenize(t))
            except Exception as err:  # noqa: BLE001
                out.append(err)
        return out


def _surrogate_reason(key: str, text: str):
    """A ``\\ud800``-style escape decodes to a lone surrogate, which is not Unicode text: no
    tokenizer can encode it (their bindings fail with messages about C++ casts)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        return (
            f"key {key!r} holds a lone surrogate U+{ord(text[err.start]):04X} at character {err.start} "
            f"(an unpaired \\u escape: not valid Unicode)"
        )
    return None


def _pack(encoded: list) -> tuple:
    """Flatten documents (+EOD) into dtype bytes; returns (bytes, lengths, empties, tokens)."""
    eod = _W["eod"]
    extra = 0 if eod is None else 1
    lens = [len(ids) for ids in encoded]
    lengths = np.array([n + extra for n in lens if n], dtype=np.int32)
    total = int(lengths.sum(dtype=np.int64))
    arr = np.empty(total, dtype=_W["dtype"])
    pos = 0
    for ids, n in zip(encoded, lens):
        if n:
            arr[pos : pos + n] = ids
            pos += n
            if extra:
                arr[pos] = eod
                pos += 1
    return arr.tobytes(), lengths, len(lens) - lengths.size, total


def _meta(task: tuple) -> tuple:
    """What the main process needs to name a place: ("lines", file, offset, line_base) etc."""
    if task[0] == "txt":
        return ("lines", task[1], 0, 1)
    return task[:4] if task[0] == "lines" else task[:3]


def encode_task(task: tuple) -> dict:
    """Tokenize one task; returns per-key packed tokens and counters, or the first error."""
    keys = _W["keys"]
    kind = task[0]
    bad: list = []  # (index within task, reason)
    texts = {k: [] for k in keys}
    source: list = []  # index within the task of each kept document
    nbytes = 0
    if kind == "lines":
        _, _fi, _off, _lb, data = task
        nbytes = len(data)
        lines = data.split(b"\n")
        if lines and lines[-1] == b"":
            lines.pop()
        for i, raw in enumerate(lines):
            if not raw.strip():
                continue
            reason = None
            try:
                obj = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as err:
                reason = f"invalid UTF-8 (byte {err.start} of the line)"
            except ValueError as err:
                reason = f"malformed JSON: {getattr(err, 'msg', err)} (column {getattr(err, 'colno', '?')})"
            else:
                if not isinstance(obj, dict):
                    reason = f"expected a JSON object, got {type(obj).__name__}"
                else:
                    for k in keys:
                        if k not in obj:
                            reason = f"missing key {k!r}"
                            break
                        if not isinstance(obj[k], str):
                            reason = f"key {k!r} is {type(obj[k]).__name__}, expected a string"
                            break
                        if b"\\u" in raw:
                            reason = _surrogate_reason(k, obj[k])
                            if reason is not None:
                                break
            if reason is not None:
                bad.append((i, reason))
                if not _W["skip"]:
                    return {"error": bad[0], "task": _meta(task)}
                continue
            source.append(i)
            for k in keys:
                texts[k].append(obj[k])
    elif kind == "rows":
        _, _fi, _rb, cols = task
        n = len(cols[keys[0]])
        for i in range(n):
            reason = None
            for k in keys:
                if cols[k][i] is None:
                    reason = f"null value in column {k!r}"
                    break
            if reason is not None:
                bad.append((i, reason))
                if not _W["skip"]:
                    return {"error": bad[0], "task": _meta(task)}
                continue
            source.append(i)
            for k in keys:
                s = cols[k][i]
                texts[k].append(s)
                nbytes += len(s)
    elif kind == "txt":
        _, _fi, data = task
        nbytes = len(data)
        try:
            texts[keys[0]].append(data.decode("utf-8"))
            source.append(0)
        except UnicodeDecodeError as err:
            line = data.count(b"\n", 0, err.start) + 1
            bad.append((line - 1, f"invalid UTF-8 (byte {err.start} of the file)"))
            if not _W["skip"]:
                return {"error": bad[0], "task": _meta(task)}
    else:  # pragma: no cover
        raise ValueError(kind)

    out = {"bad": bad, "bytes": nbytes, "keys": {}}
    docs = 0
    for k in keys:
        enc = _encode_texts(texts[k]) if texts[k] else []
        failed = 0
        for i, ids in enumerate(enc):
            if isinstance(ids, Exception):
                # cannot be encoded (e.g. lone surrogates from a \ud800 escape)
                item = (source[i], f"key {k!r} cannot be tokenized: {ids}")
                if not _W["skip"]:
                    return {"error": item, "task": _meta(task)}
                bad.append(item)
                enc[i] = []
                failed += 1
        data, lengths, empty, tokens = _pack(enc)
        empty -= failed
        out["keys"][k] = (data, lengths, empty, tokens)
        docs = max(docs, len(enc))
    out["docs"] = docs
    return out
