"""megatron-core's import without its torch.compile and wandb costs (megatron_lol/megatron_import.py).

Each case runs in a fresh interpreter: what is checked is what the first
``import megatron.core`` of a process does.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

_REPORT = """
import json, sys
import megatron_lol
from megatron_lol import megatron_import
import megatron.core
import megatron.core.jit as jit, megatron.core.timers as timers
from megatron.core.fusions.fused_bias_gelu import bias_gelu
import torch
bias, y = torch.randn(8), torch.randn(4, 8)
expected = (bias + y) * 0.5 * (1.0 + torch.tanh(0.79788456 * (bias + y) * (1 + 0.044715 * (bias + y) ** 2)))
hidden_wandb = "wandb" in sys.modules
import wandb
print(json.dumps({
    "jit_fuser": "torch.compile" if jit.jit_fuser is torch.compile else jit.jit_fuser.__name__,
    "inductor_imported": "torch._inductor.compile_fx" in sys.modules,
    "timers_wandb": None if timers.wandb is None else timers.wandb.__name__,
    "wandb_in_modules_after_import": hidden_wandb,
    "wandb_init": callable(getattr(wandb, "init", None)),
    "finder_left": any(type(f).__module__ == megatron_import.__name__ for f in sys.meta_path),
    "bias_gelu_matches": bool(torch.allclose(bias_gelu(bias, y), expected, atol=1e-6)),
}))
"""


def _report(prelude: str) -> dict:
    res = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", textwrap.dedent(prelude) + _REPORT],
        cwd=str(REPO),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_without_cuda_megatron_imports_without_torch_compile_or_wandb_and_wandb_still_imports():
    pytest.importorskip("wandb")
    report = _report("")
    assert report == {
        "jit_fuser": "noop_decorator",  # megatron-core's own disable_jit_fuser()
        "inductor_imported": False,
        "timers_wandb": None,  # megatron's timer logging took its "no wandb" branch
        "wandb_in_modules_after_import": False,  # the hiding entry is gone again
        "wandb_init": True,  # and the package's own --wandb-project sink imports the real wandb
        "finder_left": False,
        "bias_gelu_matches": True,  # the fused activation, eager, computes the same
    }


def test_with_cuda_the_jit_fuser_stays_torch_compile_and_an_imported_wandb_is_left_alone():
    pytest.importorskip("wandb")
    report = _report(
        """
        import wandb
        from megatron_lol import megatron_import
        megatron_import._cuda_available = lambda: True
        """
    )
    assert report["jit_fuser"] == "torch.compile"
    assert report["timers_wandb"] == "wandb"
    assert report["finder_left"] is False


def _jit_fuser_name() -> str:
    import megatron.core.jit

    return megatron.core.jit.jit_fuser.__name__


def test_ranks_the_tests_fork_import_megatron_core_as_the_package_does():
    from distributed import run_distributed

    assert run_distributed(_jit_fuser_name, 1) == ["noop_decorator"]
