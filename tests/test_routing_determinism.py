"""Routing decisions are the same on every rank that computes them (docs/gpu.md, "Routing on every rank").

* The routing path every device runs (the core's routed steps: document and window layouts, window
  sums, prefix means, the router-only term, router, noise, argmax, balancing loads, both auxiliary
  losses, grouping, gates, combine, and their backward) runs under a TorchDispatchMode that fails
  on any aten operation whose result depends on the order CUDA threads run in (the operations listed in
  ``torch.use_deterministic_algorithms``' documentation: float atomics of ``index_add_``, scatter-adds,
  accumulating ``index_put_``, floating-point ``cumsum``, ...).
* The ordered window sums and segmented prefix sums equal float64 references, also where the padded
  window layout is built in several chunks (many short documents).
* The routing digest changes with any single choice or gate bit.

The two-process checks (a planted divergent decision stopped by the agreement check; overlapped
gradient reduction with a block unused on one rank) are in tests/test_gpu_first_run_distributed.py.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

#: aten overloads whose CUDA kernels accumulate floats in thread order (torch.use_deterministic_algorithms)
_ALWAYS = {
    "index_add",
    "index_add_",
    "scatter_add",
    "scatter_add_",
    "put",
    "put_",
    "index_copy",
    "index_copy_",
    "histc",
    "embedding_dense_backward",
    "_embedding_bag_backward",
    "nll_loss2d_forward",
}
_SCATTER_REDUCE = {"scatter_reduce", "scatter_reduce_"}
_INDEX_PUT = {"index_put", "index_put_", "_index_put_impl_", "_unsafe_index_put"}
_SCANS = {"cumsum", "cumsum_", "cumprod", "cumprod_", "_cummax_helper", "logcumsumexp"}


def _name(func) -> str:
    return func._schema.name.split("::")[-1]


class NondeterminismRecorder(TorchDispatchMode):
    """Records every operation of the body that is nondeterministic on CUDA (values are CPU values)."""

    def __init__(self):
        super().__init__()
        self.found: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _name(func)
        why = None
        if name in _ALWAYS:
            why = "atomic float accumulation"
        elif name in _SCATTER_REDUCE:
            why = "scatter_reduce"
        elif name in _SCANS and args[0].is_floating_point():
            why = "floating-point scan"
        elif name == "bincount" and (len(args) > 1 and args[1] is not None or kwargs.get("weights") is not None):
            why = "weighted bincount"
        elif name in _INDEX_PUT:
            accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
            if accumulate and args[0].is_floating_point():
                why = "accumulating index_put"
            elif not accumulate:
                index = [i for i in args[1] if i is not None]
                keys = torch.stack([i.reshape(-1).long() for i in index]) if index else None
                if keys is not None and torch.unique(keys, dim=1).shape[1] != keys.shape[1]:
                    why = "index_put with repeated indices"
        elif name in ("scatter", "scatter_") and len(args) > 3 and isinstance(args[3], torch.Tensor):
            # a scatter writes in thread order only where two sources hit one slot (a permutation does not)
            index = args[2]
            if index.dim() != 1 or torch.unique(index).numel() != index.numel():
                why = "scatter of a tensor with repeated indices"
        if why:
            self.found.append(f"{func} ({why})")
        return func(*args, **kwargs)


class _TableExecutor:
    """An executor whose "blocks" scale each row by its block's row of a table (a per-block parameter
    gathered per row, as the grouped GEMMs' norm gains and FiLM are): the routed depth's own routing,
    grouping and combine run around it, without the layers (which are megatron-core's)."""

    grouped = True

    def __init__(self, table):
        self.table = table

    def run(self, core, step, ctx, rows, grouping, positions, *, first_block=0, counts=None):
        from megatron_lol.model.static_routing import gather_segment_rows

        return rows * gather_segment_rows(self.table, grouping.block_of_row, grouping.group_offsets)

    def fused_update(self, *args, **kwargs):
        return None


def _routing_path(net, tokens, seeds):
    """The routed depths as every device runs them (``Core.forward``'s routed steps: host layout, window
    sums, prefix means, router-only term, router and noise, argmax, loads, both auxiliary losses,
    grouping, per-block parameter gathers, gates, combine), forward and backward."""
    from megatron_lol.model.host_layout import host_layout_for_batch

    core = net.core
    b, s = tokens.shape
    h = core.cfg.hidden_size
    table = torch.randn(core.plan.num_stored_blocks, h, generator=torch.Generator().manual_seed(4))
    table.requires_grad_(True)
    core.executor = _TableExecutor(table)
    batch = {"tokens": tokens, "sample_ids": seeds}
    layout = host_layout_for_batch(batch, core.cfg, core.plan, net.eod_id, 7, pin=False)
    states = torch.randn(s, b, h, generator=torch.Generator().manual_seed(3), requires_grad=True)
    steps = list(core.plan.steps())
    out = core(
        states,
        layout.document_layout(),
        None,
        steps,
        depth=len(steps),
        layout=layout,
        noise_seeds=seeds,
        router_only=net.router_only_index(tokens),
    )
    loss = out.states.float().sum() + out.aux_loss
    loss.backward()
    return states.grad, table.grad, out.block_loads


@pytest.mark.parametrize(
    "variant",
    [
        dict(balancing="loss_free", seq_aux_loss_coeff=1e-2),
        dict(balancing="aux_loss", aux_loss_coeff=0.02, router_only_tokens=[90, 91, 92], router_only_filler=89),
    ],
    ids=["loss_free", "aux_loss_router_only"],
)
def test_routing_path_has_no_cuda_nondeterministic_operation(make_model, variant):
    net = make_model(router_std=0.5, window_size=8, window_shift=3, num_blocks=3, routed_depth=3, **variant).train()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, 89, (3, 40), generator=g)
    tokens[0, 5] = tokens[1, 17] = tokens[1, 18] = tokens[2, 33] = 0  # documents of many lengths
    if "router_only_tokens" in variant:
        tokens[0, 2] = tokens[1, 20] = tokens[2, 3] = 90
        tokens[2, 9] = 92
        assert net.router_only_index(tokens) is not None
    recorder = NondeterminismRecorder()
    with recorder:
        grad, table_grad, loads = _routing_path(net, tokens, torch.tensor([5, 6, 7]))
    assert not recorder.found, recorder.found
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0
    assert table_grad.abs().sum() > 0
    assert int(loads.sum()) > 0 and int((loads.sum(0) > 0).sum()) >= 2  # routes spread over blocks
    if "router_only_tokens" in variant:
        assert net.core.router_only_embeddings.grad.abs().sum() > 0  # the router-only term ran

    # the recorder does catch what a routing path must not run
    with NondeterminismRecorder() as caught:
        torch.zeros(3, 2).index_add_(0, torch.tensor([0, 0, 1]), torch.ones(3, 2))
        torch.cumsum(torch.ones(4), 0)
        torch.zeros(3).index_put_((torch.tensor([0, 0]),), torch.ones(2), accumulate=True)
        torch.ones(4, 2).gather(0, torch.zeros(1, 2, dtype=torch.long)).sum()
        torch.zeros(3).scatter_(0, torch.tensor([2, 2]), torch.ones(2))
        torch.zeros(3).scatter_(0, torch.tensor([2, 0, 1]), torch.ones(3))  # a permutation: fine
    names = " ".join(caught.found)
    assert "index_add_" in names and "cumsum" in names and "accumulating index_put" in names
    assert names.count("repeated indices") == 1


def test_router_only_term_has_no_cuda_nondeterministic_operation_and_equals_float64():
    from megatron_lol.model.static_routing import router_only_prefix_means

    g = torch.Generator().manual_seed(5)
    b, s, h = 3, 37, 8
    embeddings = torch.randn(4, h, generator=g)
    index = torch.randint(-3, 4, (b * s,), generator=g).clamp(min=-1)  # about half the tokens router-only
    starts = torch.zeros(b, s, dtype=torch.bool)
    starts[:, 0] = True
    starts[0, 11] = starts[1, 2] = starts[2, 30] = True
    positions = torch.zeros(b, s, dtype=torch.long)
    for r in range(b):
        for t in range(s):
            positions[r, t] = 0 if starts[r, t] else positions[r, t - 1] + 1
    positions = positions.reshape(-1)
    embeddings.requires_grad_(True)
    with NondeterminismRecorder() as recorder:
        got = router_only_prefix_means(embeddings, index, positions, s)
        got.sum().backward()
    assert not recorder.found, recorder.found
    # each embedding's gradient: the sum over tokens t of 1 / count(t) for its own occurrences up to t
    want_grad = torch.zeros(4, h, dtype=torch.float64)
    for t in range(b * s):
        first = t - int(positions[t])
        rows = [int(i) for i in index[first : t + 1] if i >= 0]
        for i in rows:
            want_grad[i] += 1.0 / len(rows)
    torch.testing.assert_close(embeddings.grad.double(), want_grad, rtol=1e-6, atol=1e-6)
    want = torch.zeros(b * s, h, dtype=torch.float64)
    for t in range(b * s):
        first = t - int(positions[t])
        rows = [int(i) for i in index[first : t + 1] if i >= 0]
        if rows:
            want[t] = embeddings.double()[rows].mean(0)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)


def _naive_means(states, layout):
    out = torch.zeros(layout.num_windows, states.shape[1], dtype=torch.float64)
    for j in range(layout.num_windows):
        first, n = int(layout.window_first_token[j]), int(layout.window_length[j])
        out[j] = states[first : first + n].double().mean(0)
    return out


@pytest.mark.parametrize("doc_every", [3, 50])
def test_ordered_window_sums_and_prefix_means_equal_float64(doc_every):
    """``doc_every=3``: documents of 3 tokens, so the padded layout [N, W, h] is built in several chunks."""
    from megatron_lol.model.windows import DocumentLayout, WindowLayout, document_prefix_means, segment_means

    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(1, 50, (2, 64), generator=g)
    tokens[:, doc_every - 1 :: doc_every] = 0
    docs = DocumentLayout.from_tokens(tokens, 0)
    states = torch.randn(2 * 64, 16, generator=g).to(torch.bfloat16)
    for depth in (1, 2):
        layout = WindowLayout.build(docs, depth, 16, 5)
        means = segment_means(states, layout.window_first_token, layout.window_length, layout.window_size)
        want = _naive_means(states, layout)
        assert means.dtype == torch.float32
        torch.testing.assert_close(means.double(), want, rtol=1e-6, atol=1e-6)
        prefix = document_prefix_means(means, layout.window_ordinal, layout.max_windows_per_doc)
        for j in range(layout.num_windows):
            k = int(layout.window_ordinal[j])
            ref = means[j - k : j].double().sum(0) / k if k else torch.zeros(16, dtype=torch.float64)
            torch.testing.assert_close(prefix[j].double(), ref, rtol=1e-6, atol=1e-6)


def test_routing_digest_sees_one_choice_and_one_gate_bit():
    from megatron_lol.parallel.routing_agreement import routing_digest

    g = torch.Generator().manual_seed(2)
    choice = torch.randint(0, 4, (300,), generator=g)
    gate = torch.rand(300, generator=g)
    base = routing_digest(choice, gate, 4)
    assert base.dtype == torch.int64 and base.shape == (7,) and int(base[0]) == 300
    assert int(base[3:].sum()) == 300
    flipped = choice.clone()
    flipped[123] = (flipped[123] + 1) % 4
    assert not torch.equal(routing_digest(flipped, gate, 4), base)
    swapped = choice.clone()
    swapped[[10, 11]] = swapped[[11, 10]]  # same counts, other windows
    if swapped[10] != swapped[11]:
        assert not torch.equal(routing_digest(swapped, gate, 4), base)
    nudged = gate.clone()
    nudged[250] = torch.nextafter(nudged[250], torch.tensor(2.0))  # one ulp
    assert not torch.equal(routing_digest(choice, nudged, 4), base)
    assert torch.equal(routing_digest(choice.clone(), gate.clone(), 4), base)
