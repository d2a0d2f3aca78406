"""BF16 runs save and resume bit for bit with every optimizer layout.

A bf16 LoL model keeps its routing parameters (window routers, depth vectors) in
FP32, so megatron-core's optimizers see FP32 and bf16 parameters in one group;
as shipped they cannot save that state (``platform/megatron_fixes.py``). Each
case trains the tiny model of ``test_checkpointing`` in bf16 for 8 iterations,
saving at 4, then resumes a copy of the checkpoint of iteration 4: iterations
5-8 must repeat the uninterrupted run's loss, gradient norm and learning rate
exactly. The single-process Adam case runs the routed depths as the grouped core, the others the
per-block reference.
"""

from __future__ import annotations

import shutil

import pytest
from test_checkpointing import assert_same_losses, make_corpus, metrics, run, tracker, write_config

pytestmark = pytest.mark.multiprocess  # gloo ranks: the whole machine (tests/suite_support.py)

ITERS, SAVE_AT = 8, 4
CASES = {
    # the routed depths grouped (host layouts, library gradients into main_grad per depth), under the
    # growing-depth curriculum of the tiny config; the other cases run the reference routed core
    "adam-grouped-core": (["--routed-core", "grouped"], 1),
    "adam-distributed-dp2": (["--use-distributed-optimizer"], 2),
    "muon": (["--optimizer", "muon"], 1),
}


@pytest.fixture(scope="module")
def bf16_config(tmp_path_factory):
    root = tmp_path_factory.mktemp("bf16")
    prefix, tok = make_corpus(root / "data")
    config = write_config(
        root / "tiny.yaml", prefix, tok, str(root / "cache"), train_iters=ITERS, save_interval=SAVE_AT
    )
    return root, config


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_bf16_checkpoint_resumes_bit_exact(bf16_config, case):
    root, config = bf16_config
    flags, nproc = CASES[case]
    flags = ["--bf16", *flags]
    ref, log = root / f"{case}-ref", root / f"{case}-ref.log"
    assert run(config, ref, *flags, log=log, nproc=nproc) == 0, log.read_text()[-3000:]
    reference = metrics(ref)
    assert sorted(reference) == list(range(1, ITERS + 1)) and tracker(ref) == ITERS

    resumed, log = root / f"{case}-resumed", root / f"{case}-resumed.log"
    resumed.mkdir()
    shutil.copytree(ref / f"iter_{SAVE_AT:07d}", resumed / f"iter_{SAVE_AT:07d}")
    (resumed / "latest_checkpointed_iteration.txt").write_text(f"{SAVE_AT}\n")
    assert run(config, resumed, *flags, log=log, nproc=nproc) == 0, log.read_text()[-3000:]
    assert "optimizer loaded" in log.read_text()
    if "--routed-core" in flags:
        assert "routed core: grouped" in log.read_text()
    got = metrics(resumed)
    assert sorted(got) == list(range(SAVE_AT + 1, ITERS + 1))
    assert_same_losses(got, reference, range(SAVE_AT + 1, ITERS + 1))
