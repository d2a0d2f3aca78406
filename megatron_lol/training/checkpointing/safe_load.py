"""Reading checkpoint files without running pickled code, with one-line errors.

A ``torch_dist`` checkpoint holds three kinds of serialized data:

* tensor payloads (``__*.distcp``) and ``common.pt``: torch reads them with
  ``torch.load(weights_only=True)``, its own restricted unpickler (megatron-core
  registers the few numpy/megatron classes they hold);
* ``.metadata``, the index of the shards, which ``torch.distributed.checkpoint``
  reads with a plain ``pickle.load``, and the sharded objects stored as bytes
  in the shards, which its ``DefaultLoadPlanner`` reads with
  ``torch.load(weights_only=False)``: a crafted file would run code.

:class:`RestrictedUnpickler` admits only the checkpoint-metadata classes of
``torch.distributed.checkpoint``. Every load of the package goes through it:
the converters call :func:`read_metadata_file`, and the trainer's, ``analyze``'s
and the converter's calls into megatron-core and torch run inside
:func:`restricted_unpickling`, which for the duration routes the metadata reads
through it and the byte objects through torch's weights-only unpickler.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import threading
import types
from typing import Optional

import torch

from megatron_lol.errors import CliError
from megatron_lol.training.checkpointing.files import CheckpointError

_ALLOWED_MODULES = (
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.filesystem",
    "torch.distributed.checkpoint.planner",
)
_ALLOWED_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
    ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id of torch's own saves
    ("pathlib", "PurePosixPath"),
}


class ForbiddenGlobal(pickle.UnpicklingError):
    """The pickle names a class or function outside the allowlist."""


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickles a DCP ``.metadata`` file, refusing any class outside the checkpoint-metadata allowlist."""

    def find_class(self, module, name):
        if module in _ALLOWED_MODULES or (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(
            getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)
        ):
            return getattr(torch, name)
        raise ForbiddenGlobal(f"refusing to load {module}.{name} from checkpoint metadata")


def restricted_load(file, **_kwargs):
    return RestrictedUnpickler(file).load()


def restricted_loads(data: bytes, **_kwargs):
    import io

    return RestrictedUnpickler(io.BytesIO(data)).load()


def read_metadata_file(path: str):
    """The parsed ``{path}/.metadata``; a one-line :class:`CheckpointError` if it is unusable."""
    name = os.path.join(path, ".metadata")
    try:
        with open(name, "rb") as f:
            return RestrictedUnpickler(f).load()
    except FileNotFoundError:
        raise CheckpointError(f"{name} is missing: not a complete torch_dist checkpoint") from None
    except ForbiddenGlobal as err:
        raise CheckpointError(f"{name}: {err} (not a checkpoint index: crafted or foreign file)") from None
    except (
        pickle.UnpicklingError,
        EOFError,
        AttributeError,
        ValueError,
        TypeError,
        IndexError,
        KeyError,
        ImportError,
        UnicodeDecodeError,
        OverflowError,
        MemoryError,
    ) as err:
        raise CheckpointError(f"{name} is truncated or corrupt ({type(err).__name__}: {_first_line(err)})") from None


_pickle_shim = types.SimpleNamespace(**{k: getattr(pickle, k) for k in dir(pickle) if not k.startswith("__")})
_pickle_shim.load = restricted_load
_pickle_shim.loads = restricted_loads


class _WeightsOnlyTorch(types.ModuleType):
    """``torch`` as ``default_planner`` sees it inside :func:`restricted_unpickling`: its
    ``load`` always runs torch's weights-only unpickler."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def load(f, *args, **kwargs):
        kwargs["weights_only"] = True
        return torch.load(f, *args, **kwargs)


_torch_shim = _WeightsOnlyTorch("torch")
_lock = threading.RLock()
_active = {"depth": 0, "saved": None}


@contextlib.contextmanager
def restricted_unpickling():
    """Within: nothing ``torch.distributed.checkpoint`` reads runs pickled code.

    Its ``.metadata`` reads go through :class:`RestrictedUnpickler`, and the
    sharded objects stored as bytes in the ``.distcp`` files (RNG states, layers'
    ``_extra_state``), which ``DefaultLoadPlanner.load_bytes`` would read with
    ``torch.load(weights_only=False)``, through torch's weights-only unpickler
    (megatron-core registers the numpy and ``BytesIO`` classes they hold).
    """
    from torch.distributed.checkpoint import default_planner, filesystem

    with _lock:
        if _active["depth"] == 0:
            _active["saved"] = (filesystem.pickle, default_planner.torch)
            filesystem.pickle = _pickle_shim
            default_planner.torch = _torch_shim
        _active["depth"] += 1
    try:
        yield
    finally:
        with _lock:
            _active["depth"] -= 1
            if _active["depth"] == 0:
                filesystem.pickle, default_planner.torch = _active["saved"]


def _first_line(err: BaseException, limit: int = 200) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return (lines[0] if lines else type(err).__name__)[:limit]


def _last_line(err: BaseException, limit: int = 240) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return (lines[-1] if lines else type(err).__name__)[:limit]


def load_common(path: str) -> dict:
    """``common.pt`` of a checkpoint (megatron-core's reader, torch's weights-only unpickler)."""
    from megatron.core import dist_checkpointing

    try:
        with restricted_unpickling():
            common = dist_checkpointing.load_common_state_dict(path)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as err:  # noqa: BLE001 - torch and megatron raise many types here
        raise CheckpointError(
            f"{os.path.join(path, 'common.pt')} cannot be read (truncated or corrupt?): {_last_line(err)}"
        ) from None
    if not isinstance(common, dict) or "iteration" not in common:
        raise CheckpointError(f"{os.path.join(path, 'common.pt')} holds no megatron-lol training state")
    return common


def load_sharded(request: dict, path: str) -> dict:
    """``dist_checkpointing.load`` with restricted metadata reads and a one-line error."""
    from megatron.core import dist_checkpointing

    try:
        with restricted_unpickling():
            return dist_checkpointing.load(request, path)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as err:  # noqa: BLE001 - CheckpointException is a BaseException
        raise CheckpointError(
            f"{path}: cannot read the checkpoint (a truncated or corrupted .distcp file?): {describe_error(err)}"
        ) from None


def describe_error(err: BaseException) -> str:
    """One line for an exception of a save or load: the OS error (ENOSPC ...) when there is one."""
    os_err = find_os_error(err)
    if os_err is not None:
        import errno

        code = errno.errorcode.get(os_err.errno, str(os_err.errno)) if os_err.errno else ""
        where = f"{os_err.filename}: " if getattr(os_err, "filename", None) else ""
        return f"{where}{os_err.strerror or _first_line(os_err)}" + (f" ({code})" if code else "")
    # an OSError that crossed a process boundary (writer process, gather) survives only as text
    import errno
    import re

    texts = [str(err)] + [
        str(f[0] if isinstance(f, tuple) else f) for f in (getattr(err, "failures", None) or {}).values()
    ]
    for text in texts:
        m = re.search(r"\[Errno (\d+)\] ([^;:\n'\"]+)", text)
        if m:
            return f"{m.group(2).strip()} ({errno.errorcode.get(int(m.group(1)), m.group(1))})"
    return _last_line(err)


def find_os_error(err: Optional[BaseException], _seen=None) -> Optional[OSError]:
    """The first ``OSError`` with an errno in an exception, its causes, or the per-rank
    failures of torch's ``CheckpointException``."""
    seen = _seen if _seen is not None else set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno:
            return err
        for failure in (getattr(err, "failures", None) or {}).values():
            inner = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(inner, BaseException):
                found = find_os_error(inner, seen)
                if found is not None:
                    return found
        for arg in getattr(err, "args", ()):
            if isinstance(arg, BaseException):
                found = find_os_error(arg, seen)
                if found is not None:
                    return found
        err = err.__cause__ or err.__context__
    return None


def check_optimizer_fits(path: str, directory: str, optimizer_request, metadata, saved_layout, layout) -> None:
    """Refuse, in one line, optimizer state laid out for another optimizer chain.

    megatron-core gives expert parameters an optimizer of their own only when
    ``expert_model_parallel_size > 1`` (their ``allreduce`` flag), so the optimizer
    state of a MoE model saved at EP=1 and at EP>1 has different keys; loading
    across that boundary would otherwise fail deep inside dist-checkpointing
    with a message that reads like a corrupt file. The weights load at any layout.
    """
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    saved = metadata.state_dict_metadata
    missing = sorted(
        {t.key for t in nested_values(optimizer_request) if isinstance(t, ShardedTensor) and t.key not in saved}
    )
    if not missing:
        return
    why = ""
    if saved_layout and (saved_layout.get("ep", 1) > 1) != (layout["ep"] > 1):
        why = (
            f" (saved at expert-model-parallel-size {saved_layout.get('ep', 1)}, now {layout['ep']}: megatron-core "
            f"keeps expert parameters in an optimizer of their own only when it is > 1)"
        )
    raise CliError(
        f"{path}: its optimizer state does not fit this run's optimizer{why}: {len(missing)} of this "
        f"run's optimizer tensors are not in it, e.g. {missing[0]}; load its weights into a new --save "
        f"(--load {directory}) with training.reset_optimizer: true"
    )
