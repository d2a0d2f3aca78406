"""The files of a save directory: names, the tracker, completeness proofs, checksums.

Nothing here needs megatron-core or process groups; the functions take paths
and return plain values, so the converters and the trainer share them.

``checksums.json`` (written into every checkpoint before it is renamed into
place) lists each file of the checkpoint with its size and SHA-256. The sizes
prove a checkpoint complete without reading it (a resume without a tracker
relies on that); the digests catch silent corruption on load.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from typing import Iterable, Optional

from megatron_lol.errors import CliError

TRACKER = "latest_checkpointed_iteration.txt"
RUN_CONFIG = "run_config.yaml"
MANIFEST = "checksums.json"
TMP_PREFIX = ".tmp_"
# files megatron-core's torch_dist format always writes; a checkpoint without one is unusable
REQUIRED_FILES = ("metadata.json", ".metadata", "common.pt")
_ITER_RE = re.compile(r"iter_(\d{7,})")
_SHARD_RE = re.compile(r"__(\d+)_\d+\.distcp")
_CHUNK = 8 << 20


class CheckpointError(CliError):
    """A checkpoint cannot be read or written; the message names the file and the cause."""


class CheckpointNotFoundError(CheckpointError):
    """The tracker or a requested iteration points at no complete checkpoint."""


# ------------------------------------------------------------------ names
def iter_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, iter_name(iteration))


def tmp_dir(root: str, iteration: int) -> str:
    return os.path.join(root, TMP_PREFIX + iter_name(iteration))


def list_checkpoints(root: Optional[str]) -> list:
    """Iterations of the ``iter_*`` directories under ``root``, ascending."""
    out = []
    if not root or not os.path.isdir(root):
        return out
    for name in os.listdir(root):
        m = _ITER_RE.fullmatch(name)
        if m and os.path.isdir(os.path.join(root, name)):
            out.append(int(m.group(1)))
    return sorted(out)


def _names(root: str, iterations: Iterable[int]) -> str:
    its = list(iterations)
    shown = [iter_name(i) for i in its[-4:]]
    return ", ".join((["..."] if len(its) > 4 else []) + shown)


# ------------------------------------------------------------------ tracker
def read_tracker(root: Optional[str]) -> Optional[int]:
    """The iteration named by ``{root}/latest_checkpointed_iteration.txt``, or None without one."""
    if not root:
        return None
    path = os.path.join(root, TRACKER)
    try:
        with open(path, "rb") as f:
            raw = f.read(4096)
    except FileNotFoundError:
        return None
    text = raw.decode("utf-8", "replace").strip()
    if not re.fullmatch(r"\d+", text):
        raise CheckpointError(
            f"{path}: expected an iteration number, got {text[:40]!r} "
            f"(write the iteration to resume from into it, or remove it)"
        )
    return int(text)


def fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def write_tracker(root: str, iteration: int) -> None:
    path = os.path.join(root, TRACKER)
    with open(path + ".tmp", "w") as f:
        f.write(f"{iteration}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)
    fsync_dir(root)


def latest_checkpoint(root: Optional[str]) -> Optional[int]:
    """The tracker's iteration (None without a tracker); an error if its directory is not usable."""
    it = read_tracker(root)
    if it is None:
        return None
    path = checkpoint_dir(root, it)
    if not os.path.exists(os.path.join(path, "metadata.json")):
        others = [i for i in list_checkpoints(root) if incomplete_reason(checkpoint_dir(root, i)) is None]
        hint = f" (complete: {_names(root, others)})" if others else ""
        raise CheckpointNotFoundError(
            f"{os.path.join(root, TRACKER)} names iteration {it} but {path} is missing or incomplete"
            f"{hint}: point the tracker at a complete checkpoint"
        )
    return it


def resume_iteration(root: Optional[str]) -> tuple:
    """``(iteration, how)`` to resume ``root`` from, or ``(None, "")`` when it holds no checkpoint.

    The tracker decides when there is one. Without it (a partial copy, a run killed
    between renaming its first checkpoint and writing the tracker) the newest
    ``iter_*`` directory is used if its ``checksums.json`` proves it complete;
    otherwise nothing is guessed and nothing is overwritten: a one-line error
    names the directories.
    """
    it = latest_checkpoint(root)
    if it is not None:
        return it, "tracker"
    found = list_checkpoints(root)
    if not found:
        return None, ""
    newest = found[-1]
    problem = incomplete_reason(checkpoint_dir(root, newest))
    if problem is None:
        return newest, f"no {TRACKER}: newest checkpoint, complete by its {MANIFEST}"
    raise CheckpointNotFoundError(
        f"{root} holds {_names(root, found)} but no {TRACKER}, and {iter_name(newest)} cannot be shown "
        f"complete ({problem}): write the iteration to resume from into {os.path.join(root, TRACKER)} "
        f"or use another --save"
    )


# ------------------------------------------------------------------ checksums
def file_digest(path: str, sync: bool = False) -> str:
    """SHA-256 of a file; with ``sync`` the file is also ``fsync``-ed (the save's commit: megatron-core's
    writers fsync their shards, but not ``common.pt`` or ``metadata.json``)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            block = f.read(_CHUNK)
            if not block:
                break
            h.update(block)
        if sync:
            os.fsync(f.fileno())
    return h.hexdigest()


def checkpoint_files(path: str) -> list:
    """Relative paths of every file of a checkpoint directory (the manifest excluded), sorted."""
    out = []
    for base, _dirs, files in os.walk(path):
        for name in files:
            rel = os.path.relpath(os.path.join(base, name), path)
            if rel != MANIFEST:
                out.append(rel)
    return sorted(out)


def files_of_rank(files: list, rank: int, world: int) -> list:
    """The files rank ``rank`` digests at save time: its own ``__{rank}_*.distcp`` shards
    (still in its node's page cache), and on rank 0 everything that is not a shard."""
    mine = []
    for rel in files:
        m = _SHARD_RE.fullmatch(rel)
        owner = int(m.group(1)) if m and int(m.group(1)) < world else 0
        if owner == rank:
            mine.append(rel)
    return mine


def digest_files(path: str, rels: list) -> dict:
    """Size and SHA-256 of each file, each one ``fsync``-ed on the way, and its directory too: everything the
    manifest lists is on stable storage before the tracker can name the checkpoint.

    The hash re-reads what was just written (from the page cache, as a rule) instead of hashing the bytes
    on their way out: megatron-core's writer serialises each shard with ``torch.save`` inside forked worker
    processes that hand back only torch's ``WriteResult`` objects, so the written bytes never pass through code
    of ours (docs/operations.md gives the cost)."""
    out = {
        rel: {
            "size": os.path.getsize(os.path.join(path, rel)),
            "sha256": file_digest(os.path.join(path, rel), sync=True),
        }
        for rel in rels
    }
    for directory in sorted({os.path.dirname(os.path.join(path, rel)) for rel in rels}):
        fsync_dir(directory)
    return out


def write_manifest(path: str, entries: dict) -> None:
    out = os.path.join(path, MANIFEST)
    with open(out + ".tmp", "w") as f:
        json.dump({"algorithm": "sha256", "files": dict(sorted(entries.items()))}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(out + ".tmp", out)


def read_manifest(path: str) -> Optional[dict]:
    """``{relative path: {"size", "sha256"}}``, or None for a checkpoint saved without one."""
    name = os.path.join(path, MANIFEST)
    try:
        with open(name) as f:
            raw = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{name} is unreadable: {err}") from None
    files = raw.get("files") if isinstance(raw, dict) else None
    if (
        raw.get("algorithm") != "sha256"
        or not isinstance(files, dict)
        or any(not isinstance(v, dict) or "size" not in v or "sha256" not in v for v in files.values())
    ):
        raise CheckpointError(f"{name} is not a checksum manifest of megatron-lol")
    return files


def incomplete_reason(path: str) -> Optional[str]:
    """Why ``path`` cannot be shown complete without reading it (None: every file of its
    manifest is there with its recorded size)."""
    if not os.path.isdir(path):
        return "no such directory"
    try:
        files = read_manifest(path)
    except CheckpointError as err:
        return str(err)
    if files is None:
        return f"no {MANIFEST}"
    for name in REQUIRED_FILES:
        if name not in files:
            return f"{MANIFEST} does not list {name}"
    return size_problem(path, files)


def written_by(rel: str) -> str:
    """``" (written by rank R)"`` for a shard of megatron's writer (``__R_I.distcp``: R is the global rank that
    wrote it, so the node whose disk or memory failed), else ``""``."""
    m = re.fullmatch(r"__(\d+)_\d+\.distcp", os.path.basename(rel))
    return f" (written by rank {m.group(1)})" if m else ""


def size_problem(path: str, files: dict) -> Optional[str]:
    for rel, entry in files.items():
        full = os.path.join(path, rel)
        try:
            size = os.path.getsize(full)
        except OSError:
            return f"{full}{written_by(rel)} is missing"
        if size != entry["size"]:
            return f"{full} is corrupted or truncated ({size} bytes, {entry['size']} were saved){written_by(rel)}"
    return None


def verify_files(path: str, files: dict, rels: list) -> Optional[str]:
    """The first problem among ``rels`` (size, then SHA-256), or None."""
    problem = size_problem(path, {rel: files[rel] for rel in rels})
    if problem is not None:
        return problem
    for rel in rels:
        if file_digest(os.path.join(path, rel)) != files[rel]["sha256"]:
            return (
                f"{os.path.join(path, rel)} is corrupted or truncated: its SHA-256 differs from the one "
                f"saved in {MANIFEST}{written_by(rel)} (training.verify_checksums=false skips this check)"
            )
    return None


def verify_checkpoint(path: str) -> None:
    """One process: every file of ``path`` against its ``checksums.json`` (none: nothing to check)."""
    files = read_manifest(path)
    problem = verify_files(path, files, sorted(files)) if files is not None else None
    if problem is not None:
        raise CheckpointError(problem)


# ------------------------------------------------------------------ metrics
def truncate_metrics(path: Optional[str], iteration: int) -> int:
    """Drop the records a resumed run logs again: every ``step`` after ``iteration`` (all of
    them when it restarts at 0), and lines cut by a kill. Returns how many were dropped."""
    if not path or not os.path.isfile(path):
        return 0
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    kept, dropped = [], 0
    for line in lines:
        if not line.strip():
            continue
        try:
            step = int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            dropped += 1
            continue
        if iteration == 0 or step > iteration:
            dropped += 1
        else:
            kept.append(line)
    if dropped:
        with open(path + ".tmp", "wb") as f:
            f.write(b"".join(line + b"\n" for line in kept))
            f.flush()
            os.fsync(f.fileno())
        os.replace(path + ".tmp", path)
    return dropped
