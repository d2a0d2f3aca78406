"""One model whatever the tensor-parallel size: vocabulary padding and its record in checkpoints.

The tokenizer here has 520 pieces and ``make_vocab_size_divisible_by: 64``:
padded to 576 rows at every TP size (Megatron-LM's rule would give 576 at TP=1
and 640 at TP=2). One launch of 2 gloo ranks runs the same config at TP=1
(DP=2) and TP=2 without pinning ``vocab_size``, resumes the TP=1 checkpoint at
TP=2, and resumes a checkpoint that records another size (640, as a run with
Megatron-LM's padding wrote it) without being told that size.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TOKENS = 520
STEPS = 5
SAVE_INTERVAL = 3


class _Tokenizer:
    vocab_size = TOKENS
    eod = 0


def _cfg(tp: int, save: str, vocab_size=None, divisible_by: int = 64):
    from megatron_lol.config import config_from_dict

    return config_from_dict(
        {
            "model": {
                "plan": "lol",
                "hidden_size": 32,
                "num_attention_heads": 4,
                "ffn_hidden_size": 64,
                "n_prelude": 1,
                "n_coda": 1,
                "num_blocks": 3,
                "routed_depth": 3,
                "window_size": 8,
                "window_shift": 4,
                "make_vocab_size_divisible_by": divisible_by,
                "vocab_size": vocab_size,
            },
            "parallel": {"tensor_model_parallel_size": tp},
            "training": {
                "train_iters": STEPS,
                "micro_batch_size": 2,
                "global_batch_size": 4,
                "seq_length": 32,
                "log_interval": 100,
                "eval_interval": 100,
                "eval_iters": 0,
                "seed": 7,
                "save": save,
                "save_interval": SAVE_INTERVAL,
            },
            "optimizer": {"lr": 1e-2, "lr_warmup_iters": 0},
        }
    )


def _train(tp: int, save: str, vocab_size=None) -> dict:
    from megatron_lol.training.profile import SyntheticDataset
    from megatron_lol.training.trainer import Trainer

    cfg = _cfg(tp, save, vocab_size)
    ds = SyntheticDataset(cfg.training.seq_length, TOKENS, eod=0, seed=3)
    trainer = Trainer(cfg, tokenizer=_Tokenizer(), datasets=(ds, None, None)).setup()
    results = trainer.train().results
    loaded = getattr(trainer.checkpointer, "loaded_from", None)
    return {"vocab": trainer.vocab_size, "losses": {r.step: r.loss for r in results}, "loaded": loaded}


def _copy_checkpoint(src: str, dst: str, iteration: int) -> None:
    """Rank 0 copies ``src``'s checkpoint of ``iteration`` into a fresh save dir ``dst``."""
    import shutil

    import torch

    name = f"iter_{iteration:07d}"
    if torch.distributed.get_rank() == 0:
        os.makedirs(dst)
        shutil.copytree(os.path.join(src, name), os.path.join(dst, name))
        with open(os.path.join(dst, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(f"{iteration}\n")
    torch.distributed.barrier()


def _layouts(root: str) -> dict:
    out = {"tp1": _train(1, os.path.join(root, "tp1")), "tp2": _train(2, os.path.join(root, "tp2"))}
    _copy_checkpoint(os.path.join(root, "tp1"), os.path.join(root, "tp1_to_tp2"), SAVE_INTERVAL)
    out["tp1_to_tp2"] = _train(2, os.path.join(root, "tp1_to_tp2"))
    # a checkpoint padded by Megatron-LM's rule at TP=2 (640 rows), resumed at TP=1 without vocab_size
    out["old_tp2"] = _train(2, os.path.join(root, "old_tp2"), vocab_size=640)
    _copy_checkpoint(os.path.join(root, "old_tp2"), os.path.join(root, "old_to_tp1"), SAVE_INTERVAL)
    out["old_to_tp1"] = _train(1, os.path.join(root, "old_to_tp1"))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One launch of 2 ranks (forked as ``srun`` starts them, non-daemonic: the trainer's checkpoint
    writer starts processes of its own; tests/cli_processes.py)."""
    import cli_processes

    root = tmp_path_factory.mktemp("vocab")
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONWARNINGS="ignore",
        PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]),
    )
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    status, out = cli_processes.run_ranks(
        [__file__, str(root)], 2, env=env, cwd=REPO, log=root / "ranks.log", timeout=600
    )
    assert status == 0, out[-6000:]
    out = json.loads((root / "results.json").read_text())
    for run in out.values():
        run["losses"] = {int(k): v for k, v in run["losses"].items()}
    return out, root


@pytest.mark.slow
@pytest.mark.multiprocess
def test_same_config_same_model_at_tp1_and_tp2(runs):
    out, _ = runs
    assert out["tp1"]["vocab"] == out["tp2"]["vocab"] == 576
    a, b = out["tp1"]["losses"], out["tp2"]["losses"]
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    for s in range(1, 4):
        assert abs(a[s] - b[s]) <= 1e-5 * abs(a[s]), (s, a[s], b[s])


@pytest.mark.slow
def test_tp1_checkpoint_resumes_at_tp2(runs):
    out, root = runs
    res = out["tp1_to_tp2"]
    assert res["loaded"] == str(root / "tp1_to_tp2" / f"iter_{SAVE_INTERVAL:07d}")
    assert res["vocab"] == 576 and sorted(res["losses"]) == list(range(SAVE_INTERVAL + 1, STEPS + 1))
    ref = out["tp1"]["losses"]
    for s, loss in res["losses"].items():
        assert abs(loss - ref[s]) <= 1e-5 * abs(ref[s]), (s, loss, ref[s])


@pytest.mark.slow
def test_recorded_vocabulary_is_kept_under_another_layout(runs):
    out, root = runs
    from megatron_lol.training.vocab import recorded_vocab_size

    assert out["old_tp2"]["vocab"] == 640
    assert recorded_vocab_size(str(root / "old_tp2" / f"iter_{SAVE_INTERVAL:07d}")) == 640
    res = out["old_to_tp1"]
    assert res["vocab"] == 640 and res["loaded"] is not None
    ref = out["old_tp2"]["losses"]
    for s, loss in res["losses"].items():
        assert abs(loss - ref[s]) <= 1e-5 * abs(ref[s]), (s, loss, ref[s])


def test_padding_rule_and_errors(tmp_path):
    from megatron_lol.errors import ConfigError
    from megatron_lol.model.lol_model import padded_vocab_size
    from megatron_lol.training.vocab import resolve_vocab_size

    assert padded_vocab_size(8000, 128) == padded_vocab_size(8000, 128, 2) == padded_vocab_size(8000, 128, 8) == 8064
    assert padded_vocab_size(520, 64, 1) == padded_vocab_size(520, 64, 2) == 576
    cfg = _cfg(4, str(tmp_path / "none"), divisible_by=6)
    with pytest.raises(ConfigError, match="tensor_model_parallel_size: 4 does not divide the vocabulary of 522"):
        resolve_vocab_size(cfg, TOKENS)
    with pytest.raises(ConfigError, match="smaller than the tokenizer's 520"):
        resolve_vocab_size(_cfg(1, str(tmp_path / "none"), vocab_size=512), TOKENS)
    # a pinned size that contradicts the checkpoint to load is refused before any tensor is read
    save = tmp_path / "ckpt"
    (save / "iter_0000003").mkdir(parents=True)
    (save / "iter_0000003" / "metadata.json").write_text("{}")
    (save / "iter_0000003" / "run_config.yaml").write_text("checkpoint: {padded_vocab_size: 640}\n")
    (save / "latest_checkpointed_iteration.txt").write_text("3\n")
    assert resolve_vocab_size(_cfg(2, str(save)), TOKENS) == 640
    with pytest.raises(ConfigError, match="model.vocab_size: 576 but the checkpoint to load"):
        resolve_vocab_size(_cfg(2, str(save), vocab_size=576), TOKENS)


if __name__ == "__main__":  # a rank of the `runs` fixture (tests/cli_processes.py)
    import torch

    torch.set_num_threads(1)
    results = _layouts(sys.argv[1])
    if torch.distributed.get_rank() == 0:
        Path(sys.argv[1], "results.json").write_text(json.dumps(results))
