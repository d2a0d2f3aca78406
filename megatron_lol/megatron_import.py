"""The cost of importing megatron-core, cut where it buys nothing.

``import megatron.core`` runs the whole package: about 5 s of CPU per process
on the 2-core CI machine, paid again by every rank of every launch. Two parts of
it do nothing for this package:

* ``megatron.core.jit`` sets ``jit_fuser = torch.compile`` (torch >= 2.2) and the
  fused activations in ``megatron/core/fusions/`` decorate themselves with it
  while the package imports. The first ``torch.compile(fn)`` call imports
  ``torch._dynamo`` and ``torch._inductor`` (about 1.5 s). Without CUDA those
  fusions would be compiled by inductor's C++ back-end on first call, which this
  package never wants on CPU; megatron-core's own ``disable_jit_fuser()`` turns
  the decorator into the identity (``megatron/core/jit.py``). With CUDA nothing
  changes: the fused kernels stay compiled.
* ``megatron.core.timers`` and ``megatron.core.inference.contexts.dynamic_context``
  run ``import wandb`` (about 0.6 s) for megatron's timer and inference-engine
  logging, which this package never calls (its own W&B sink in
  ``training/console.py`` imports wandb itself under ``--wandb-project``).
  While the ``megatron.core`` package itself runs, ``sys.modules["wandb"]`` is
  ``None``, so those two modules take their "wandb is not installed" branch;
  afterwards the entry is removed and ``import wandb`` works as before. (A
  lazily loaded module would not do: ``inspect.getmodule``, which
  ``torch.library`` calls while megatron-core imports, reads ``__file__`` of
  every module in ``sys.modules`` and so loads it.)

:func:`install` adds a finder to ``sys.meta_path`` that acts when megatron-core
is first imported, and removes itself once both are done. It is called from
``megatron_lol/__init__.py``, so it is in place in every process of this
package before anything imports megatron-core; it imports nothing heavy itself.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import sys


class _MegatronImportFinder(importlib.abc.MetaPathFinder):
    """Runs the imports of ``megatron.core`` and ``megatron.core.jit`` inside the contexts below."""

    def __init__(self) -> None:
        self.pending = {"megatron.core": _without_wandb, "megatron.core.jit": _jit_fuser_only_with_cuda}

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.pending:
            return None
        spec = _spec_from_other_finders(self, fullname, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _LoaderInContext(spec.loader, self.pending.pop(fullname))
        if not self.pending:
            uninstall()
        return spec


class _LoaderInContext(importlib.abc.Loader):
    """The real loader, with its module's code run inside ``context(module)``."""

    def __init__(self, loader, context) -> None:
        self._loader = loader
        self._context = context

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        with self._context(module):
            self._loader.exec_module(module)

    def __getattr__(self, name):
        return getattr(self._loader, name)


def _spec_from_other_finders(finder, fullname, path, target):
    for other in sys.meta_path:
        if other is finder or not hasattr(other, "find_spec"):
            continue
        spec = other.find_spec(fullname, path, target)
        if spec is not None:
            return spec
    return None


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


@contextlib.contextmanager
def _jit_fuser_only_with_cuda(jit_module):
    yield
    if not _cuda_available():
        jit_module.disable_jit_fuser()


@contextlib.contextmanager
def _without_wandb(_package):
    """``import wandb`` fails inside (unless wandb was imported already)."""
    hide = "wandb" not in sys.modules
    if hide:
        sys.modules["wandb"] = None
    try:
        yield
    finally:
        if hide and "wandb" in sys.modules and sys.modules["wandb"] is None:
            del sys.modules["wandb"]


_FINDER: _MegatronImportFinder | None = None


def install() -> None:
    """Put the finder first on ``sys.meta_path`` unless megatron-core is already imported."""
    global _FINDER
    if _FINDER is not None or "megatron.core" in sys.modules:
        return
    _FINDER = _MegatronImportFinder()
    sys.meta_path.insert(0, _FINDER)


def uninstall() -> None:
    """Take the finder off ``sys.meta_path`` (it also does so itself after both imports)."""
    if _FINDER is not None and _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
