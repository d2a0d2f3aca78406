"""Building, caching and falling back from the CPU backend's fused routing kernels (megatron_lol/backends/cpu)."""

from __future__ import annotations

import logging

import pytest
import torch

from megatron_lol.backends.cpu import kernels as cpu_kernels


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    monkeypatch.setenv(cpu_kernels.DIR_ENV, str(tmp_path / "kernels"))
    monkeypatch.setenv(cpu_kernels.ENABLE_ENV, "1")
    cpu_kernels.reset()
    yield tmp_path / "kernels"
    cpu_kernels.reset()


def test_builds_once_into_the_cache_and_reuses_it(fresh):
    kernels = cpu_kernels.routing_kernels()
    assert kernels is not None
    libs = list(fresh.glob("routing_cpu-*.so"))
    assert libs == [kernels.path]
    stamp = kernels.path.stat().st_mtime_ns
    assert cpu_kernels.build() == kernels.path  # cached: not compiled again
    assert kernels.path.stat().st_mtime_ns == stamp
    assert not list(fresh.glob(".*"))  # no temporary file left behind


def test_forward_matches_torch_bit_for_bit_and_backward_by_hand(fresh):
    kernels = cpu_kernels.routing_kernels()
    g = torch.Generator().manual_seed(0)
    T, h, N = 23, 13, 5  # h not a multiple of 8: the kernel's tail loop runs too
    states = torch.randn(T, h, generator=g)
    order = torch.randperm(T, generator=g)
    segments = torch.randint(0, N, (T,), generator=g)
    gate = torch.rand(N, generator=g)
    counts = [9, 0, 14]
    outs = [torch.randn(n, h, generator=g) for n in counts]
    new = kernels.gated_combine_forward(states, outs, counts, order, segments, gate)
    updates = torch.cat(outs) - states[order]
    want = states.index_add(0, order, gate[segments].unsqueeze(1) * updates)
    assert torch.equal(new, want)

    grad = torch.randn(T, h, generator=g)
    grad_outs, grad_states, gate_token = kernels.gated_combine_backward(
        grad, states, outs, counts, order, segments, gate
    )
    token_gate = gate[segments].unsqueeze(1)
    assert torch.equal(torch.cat(grad_outs), token_gate * grad[order])
    assert torch.equal(grad_states[order], grad[order] - token_gate * grad[order])
    torch.testing.assert_close(gate_token, (grad[order] * updates).sum(1), rtol=1e-6, atol=1e-6)


def test_no_compiler_warns_once_and_falls_back(fresh, monkeypatch, caplog):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
        assert cpu_kernels.routing_kernels() is None
        assert cpu_kernels.routing_kernels() is None
    warnings = [r.getMessage() for r in caplog.records if "unavailable" in r.getMessage()]
    assert len(warnings) == 1 and "/nonexistent/cc" in warnings[0]
    assert not fresh.exists() or not list(fresh.iterdir())


def test_compile_error_names_the_compiler_and_leaves_no_file(fresh, monkeypatch, tmp_path):
    bad = tmp_path / "bad.c"
    bad.write_text("this is not C\n")
    with pytest.raises(cpu_kernels.KernelBuildError, match="failed to compile bad.c"):
        cpu_kernels.build(bad, fresh)
    assert list(fresh.iterdir()) == []


def test_disabled_by_environment(fresh, monkeypatch, caplog):
    monkeypatch.setenv(cpu_kernels.ENABLE_ENV, "0")
    with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
        assert cpu_kernels.routing_kernels() is None
    assert not caplog.records
    assert not fresh.exists()
