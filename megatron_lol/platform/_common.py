"""Shared bookkeeping of the platform patches: the megatron-core pin, moved-name checks, the
record of what was applied."""

from __future__ import annotations

import types
from typing import Any, Callable

MEGATRON_CORE_PIN = "0.16.1"

_APPLIED: list[str] = []


class PlatformPatchError(RuntimeError):
    """A private megatron-core name that a platform patch relies on has moved."""


def _megatron_version() -> str:
    try:
        from importlib.metadata import version

        return version("megatron-core")
    except Exception:  # pragma: no cover - metadata missing
        return "unknown"


def _require(module: types.ModuleType, name: str, patch: str) -> Any:
    """Return ``module.name`` or fail loudly naming the moved private name."""
    if not hasattr(module, name):
        raise PlatformPatchError(
            f"platform patch {patch!r} needs {module.__name__}.{name}, which does not "
            f"exist in the installed megatron-core {_megatron_version()} "
            f"(patches are written for megatron-core=={MEGATRON_CORE_PIN}); "
            f"the name has moved: update megatron_lol/platform/"
        )
    return getattr(module, name)


def _require_source(func: Callable, snippet: str, patch: str) -> None:
    """Fail loudly when the code a patch works around no longer looks as expected."""
    import inspect

    try:
        src = inspect.getsource(func)
    except (OSError, TypeError):  # pragma: no cover - source not shipped
        return
    if snippet not in src:
        raise PlatformPatchError(
            f"platform patch {patch!r}: {func.__module__}.{func.__qualname__} no longer "
            f"contains {snippet!r} (installed megatron-core {_megatron_version()}, "
            f"patches are written for {MEGATRON_CORE_PIN}); update megatron_lol/platform/"
        )


def _mark(name: str) -> bool:
    """Record a patch as applied; False if it already was (idempotence)."""
    if name in _APPLIED:
        return False
    _APPLIED.append(name)
    return True


def applied_patches() -> list[str]:
    """Names of the patches applied so far in this process."""
    return list(_APPLIED)
