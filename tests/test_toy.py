"""The 4-primitive program toy (examples/toy_primitives, after the blog article "Library of
Layers: a transformer that picks its own layer order"): task generator,
held-out split, routing of every model kind, and one tiny training run."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "toy_primitives"))

import toy  # noqa: E402


def test_primitives():
    x = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 9]])
    assert toy.apply_primitive(0, x).tolist() == [[1, 2, 3, 4, 5, 6, 7, 0]]  # inc
    assert toy.apply_primitive(1, x).tolist() == [[9, 6, 5, 4, 3, 2, 1, 0]]  # rev
    assert toy.apply_primitive(2, x).tolist() == [[1, 2, 3, 4, 5, 6, 9, 0]]  # rot left by one
    assert toy.apply_primitive(3, x).tolist() == [[0, 3, 6, 9, 2, 5, 8, 7]]  # mul3 mod 10
    # steps apply in order: inc then mul3 != mul3 then inc
    assert toy.run_program((0, 3, 1), x).tolist() != toy.run_program((3, 0, 1), x).tolist()


def test_programs_and_split():
    progs = toy.all_programs()
    assert len(progs) == 64 and len(set(progs)) == 64
    for seed in range(5):
        trained, held = toy.split_programs(seed)
        assert len(trained) == 48 and len(held) == 16 and not set(trained) & set(held)
        assert set(trained) | set(held) == set(progs)
        # every primitive at every step among the trained programs
        for step in range(3):
            assert {p[step] for p in trained} == {0, 1, 2, 3}
        assert toy.covers_every_step(trained)
    assert toy.split_programs(0) == toy.split_programs(0)
    assert not toy.covers_every_step([(0, 0, 0), (1, 1, 1)])


def test_batches_are_correct_and_step_specific():
    trained, _ = toy.split_programs(0)
    g = torch.Generator().manual_seed(0)
    b = toy.make_batch(trained, 300, g)
    assert b["tokens"].shape == (300, 11) and b["targets"].shape == (300, 8)
    for i in range(0, 300, 37):
        prog = tuple(b["program"][i].tolist())
        assert prog in trained
        assert toy.program_index(prog) == int(b["program_id"][i])
        digits = b["tokens"][i, 3:]
        assert toy.run_program(prog, digits[None])[0].tolist() == b["targets"][i].tolist()
        # program token of step s names (s, primitive): 10 + 4 s + p
        assert b["tokens"][i, :3].tolist() == [10 + 4 * s + p for s, p in enumerate(prog)]
    assert int(b["tokens"].max()) < toy.VOCAB


@pytest.mark.parametrize(
    "label,blocks,params",
    [("dense", 3, None), ("oracle", 4, 202_826), ("step_prim", 12, 602_698), ("program_id", 4, 202_826)],
)
def test_fixed_paths_and_sizes(label, blocks, params):
    model = toy.ToyModel(toy.ModelSpec(label, toy.default_blocks(label)))
    assert len(model.blocks) == blocks
    if params is not None:  # the article's 203k (4 blocks) and 603k (12 blocks)
        assert toy.count_params(model) == params
    g = torch.Generator().manual_seed(1)
    trained, _ = toy.split_programs(0)
    b = toy.make_batch(trained, 64, g)
    out = model(b)
    assert out.shape == (64, 8, 10)
    path = model.last_choices
    prog = b["program"]
    if label == "oracle":
        assert torch.equal(path, prog)
    if label == "step_prim":
        assert torch.equal(path, prog + 4 * torch.arange(3))
    if label == "dense":
        assert (path == torch.arange(3)).all()
    if label == "program_id":  # a function of the program, the same for every example of it
        for pid in b["program_id"].unique():
            rows = path[b["program_id"] == pid]
            assert (rows == rows[0]).all()


def test_learned_router_and_router_only():
    trained, _ = toy.split_programs(0)
    g = torch.Generator().manual_seed(2)
    b = toy.make_batch(trained, 32, g)
    for spec in (
        toy.ModelSpec("lol", 4, tied=True),
        toy.ModelSpec("lol", 8, tied=False),
        toy.ModelSpec("lol_router_only", 4),
    ):
        model = toy.ToyModel(spec)
        assert len(model.routers) == (1 if spec.tied else 3)
        out = model(b)
        assert out.shape == (32, 8, 10) and model.last_loads.sum().item() == 3 * 32
        model.update_bias(1e-3)
        assert model.bias.abs().max().item() == pytest.approx(1e-3)
    # router-only: changing the program tokens changes nothing but the routing
    model = toy.ToyModel(toy.ModelSpec("lol_router_only", 4)).eval()
    with torch.no_grad():
        model.bias.copy_(torch.tensor([0.0, 0.0, 0.0, 0.0]))
        model.routers[0].logits.weight.zero_()
        model.routers[0].logits.bias.copy_(torch.tensor([5.0, 0, 0, 0]))  # always block 0
        b2 = dict(b, tokens=b["tokens"].clone())
        b2["tokens"][:, :3] = 10 + 4 * torch.arange(3) + (b["program"] + 1) % 4
        torch.testing.assert_close(model(b), model(b2))


def test_tiny_training_smoke():
    torch.set_num_threads(1)
    cfg = toy.TrainConfig(steps=40, batch=32, warmup=5, eval_examples=128)
    res = toy.train_one(toy.ModelSpec("oracle", 4), seed=0, cfg=cfg)
    assert 0.0 <= res["heldout_acc"] <= 1.0 and 0.0 <= res["train_acc"] <= 1.0
    assert res["final_loss"] < 2.3  # below chance (ln 10) after 40 steps
    res = toy.train_one(
        toy.ModelSpec("lol", 4), seed=0, cfg=toy.TrainConfig(steps=10, batch=16, warmup=2, eval_examples=64)
    )
    assert 0.25 <= res["separation"] <= 1.0 and 1 / 3 - 1e-6 <= res["depth_concentration"] <= 1.0
