"""Shared fixtures: one megatron-core process state per test session, tiny LoL models."""

from __future__ import annotations

import pytest
import torch

SEED = 1234
VOCAB = 97
EOD = 0


def ensure_megatron(seed: int = SEED) -> None:
    """setup_platform + world-size-1 process group + TP=PP=1 parallel state (idempotent)."""
    from megatron_lol.platform import init_distributed, setup_platform

    setup_platform()
    init_distributed()
    from megatron.core import parallel_state, tensor_parallel

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


@pytest.fixture(scope="session")
def megatron_env():
    # tiny models: one intra-op thread is ~10x faster than OpenMP on a shared 2-core box
    torch.set_num_threads(1)
    ensure_megatron()
    yield


def tiny_config(**model):
    """A tiny LoL ``ModelConfig``; keyword arguments override ``model.*`` keys."""
    from megatron_lol.config import config_from_dict

    base = dict(
        hidden_size=32,
        num_attention_heads=4,
        num_blocks=3,
        routed_depth=4,
        window_size=8,
        window_shift=4,
        n_prelude=1,
        n_coda=1,
    )
    base.update(model)
    return config_from_dict({"model": base}).model


@pytest.fixture
def make_model(megatron_env):
    """Factory ``make_model(seed=..., router_std=..., **model_keys) -> LoLGPTModel`` (eval mode).

    ``router_std`` > 0 replaces the zero-initialised router weights by N(0, std) so that
    routing is not a tie everywhere; the same seed gives the same weights.
    """

    def build(seed: int = SEED, router_std: float = 0.0, vocab: int = VOCAB, eod: int = EOD, **model):
        from megatron_lol.model.lol_model import LoLGPTModel

        ensure_megatron(seed)
        torch.manual_seed(seed)
        net = LoLGPTModel(tiny_config(**model), vocab, eod, init_seed=seed)
        if router_std > 0 and hasattr(net.core, "routers"):
            gen = torch.Generator().manual_seed(seed + 1)
            with torch.no_grad():
                for router in net.core.routers:
                    router.logits.weight.copy_(torch.randn(router.logits.weight.shape, generator=gen) * router_std)
                    router.logits.bias.zero_()
        return net.eval()

    return build


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` need CUDA: skipped without it (CI is a CPU machine); bench/gpu/run_all.sh runs them."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run by bench/gpu/run_all.sh on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
