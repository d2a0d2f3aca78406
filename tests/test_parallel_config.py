"""Scale-out pieces that need no GPU: layout validation, TE/FP8 selection, recompute, torchrun launch."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from megatron_lol.config import ConfigError, config_from_dict

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cfg(model=None, parallel=None):
    base = dict(
        hidden_size=64,
        num_attention_heads=4,
        num_blocks=4,
        routed_depth=4,
        window_size=8,
        window_shift=4,
        n_prelude=1,
        n_coda=1,
    )
    base.update(model or {})
    return {"model": base, "parallel": parallel or {}}


@pytest.mark.parametrize(
    "parallel,key",
    [
        ({"expert_model_parallel_size": 3}, "parallel.expert_model_parallel_size"),
        ({"tensor_model_parallel_size": 3}, "parallel.tensor_model_parallel_size"),
        ({"pipeline_model_parallel_size": 4}, "parallel.pipeline_model_parallel_size"),
        (
            {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2},
            "parallel.pipeline_model_parallel_size",
        ),
        ({"virtual_pipeline_model_parallel_size": 2}, "parallel.virtual_pipeline_model_parallel_size"),
        ({"sequence_parallel": True}, "parallel.sequence_parallel"),
    ],
)
def test_invalid_layouts_name_the_key(parallel, key):
    with pytest.raises(ConfigError) as err:
        config_from_dict(_cfg(parallel=parallel))
    assert str(err.value).startswith(key) and "\n" not in str(err.value)


def test_world_size_must_match_layout():
    cfg = config_from_dict(
        _cfg(parallel={"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}, model={"routed_depth": 2})
    )
    assert cfg.parallel.data_parallel_size(8) == 2
    with pytest.raises(ConfigError, match="world size 6"):
        cfg.parallel.data_parallel_size(6)


def test_fp8_and_te_need_transformer_engine_here():
    with pytest.raises(ConfigError, match=r"^model\.precision\.fp8: e4m3 needs Transformer Engine"):
        config_from_dict(_cfg(model={"fp8": "e4m3", "params_dtype": "bf16"}))
    with pytest.raises(ConfigError, match=r"^model\.precision\.fp8: must be one of"):
        config_from_dict(_cfg(model={"fp8": "e5m2"}))
    with pytest.raises(ConfigError, match=r"^model\.precision\.transformer_engine"):
        config_from_dict(_cfg(model={"use_transformer_engine": True}))


def test_spec_selection_and_thd_params(megatron_env):
    from megatron_lol.model.attention import SegmentCausalAttention
    from megatron_lol.model.block_call import LoLTransformerLayer
    from megatron_lol.model.library import LocalRMSNorm, block_spec, thd_params, use_te_for

    cfg = config_from_dict(_cfg())
    assert use_te_for(cfg.model) is (torch.cuda.is_available() and _te_imports())
    spec = block_spec(use_te=False)
    assert spec.submodules.self_attention.submodules.core_attention is SegmentCausalAttention
    assert spec.submodules.input_layernorm is LocalRMSNorm and spec.module is LoLTransformerLayer
    # windows of length 3, 4, 1, 2 packed back to back
    psp, padded = thd_params(torch.tensor([5, 5, 5, 9, 9, 9, 9, 2, 7, 7]), max_seqlen=4)
    assert psp.qkv_format == "thd" and padded == 10
    assert psp.cu_seqlens_q.tolist() == [0, 3, 7, 8, 10] and psp.max_seqlen_q == 4
    # FP8: padded to 16 rows, the 6 padding rows one more sequence
    psp, padded = thd_params(torch.tensor([5, 5, 5, 9, 9, 9, 9, 2, 7, 7]), max_seqlen=4, pad_to=16)
    assert padded == 16 and psp.cu_seqlens_q.tolist() == [0, 3, 7, 8, 10, 16] and psp.max_seqlen_q == 6


def _te_imports():
    from megatron_lol.platform import has_transformer_engine

    return has_transformer_engine()


@pytest.mark.parametrize("granularity", ["full", "selective"])
def test_recompute_gives_the_same_loss_and_gradients(megatron_env, granularity):
    from megatron_lol.config import ParallelConfig
    from megatron_lol.model.lol_model import LoLGPTModel

    cfg = config_from_dict(_cfg(model={"film": "depth"}))
    tokens = torch.randint(1, 90, (2, 32), generator=torch.Generator().manual_seed(0))
    results = []
    for rec in (None, granularity):
        model = LoLGPTModel(cfg.model, 96, 0, parallel=ParallelConfig(recompute_granularity=rec), init_seed=3)
        model.train()
        loss = model(tokens, labels=tokens, noise_seeds=torch.tensor([11, 12])).mean()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((loss.detach(), grads))
    (l0, g0), (l1, g1) = results
    assert torch.equal(l0, l1)
    assert g0.keys() == g1.keys() and len(g0) > 10
    for name in g0:
        torch.testing.assert_close(g0[name], g1[name], rtol=1e-5, atol=1e-7, msg=name)


def _write_dataset(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path / "synthetic_text_document")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=__import__("numpy").uint16)
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        n = int(torch.randint(20, 120, (1,), generator=gen))
        doc = torch.randint(3, 990, (n,), generator=gen).tolist() + [2]
        builder.add_document(torch.tensor(doc), [len(doc)])
    builder.finalize(prefix + ".idx")
    return prefix


@pytest.mark.slow
@pytest.mark.multiprocess
def test_torchrun_launch_and_layout_error(tmp_path):
    """torchrun --nproc-per-node 2 -m megatron_lol train works with gloo; a bad layout fails first, in
    one line naming the flag, with the configuration errors' exit status."""
    from corpus_fixtures import stdlib_documents, train_sentencepiece

    spm = train_sentencepiece(stdlib_documents(max_bytes=300_000), str(tmp_path / "spm"), vocab_size=1000)
    prefix = _write_dataset(tmp_path)
    config = tmp_path / "tiny.yaml"
    config.write_text(
        json.dumps(
            {
                "model": {
                    "hidden_size": 32,
                    "num_attention_heads": 2,
                    "num_blocks": 2,
                    "routed_depth": 2,
                    "window_size": 16,
                    "window_shift": 8,
                },
                "data": {
                    "paths": [prefix],
                    "split": "90,10,0",
                    "tokenizer_model": spm,
                    "cache_dir": str(tmp_path / "cache"),
                },
                "training": {
                    "train_iters": 2,
                    "micro_batch_size": 2,
                    "seq_length": 64,
                    "log_interval": 1,
                    "eval_interval": 2,
                    "eval_iters": 1,
                    "save": str(tmp_path / "run"),
                },
            }
        )
    )
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "-m",
        "megatron_lol",
        "train",
        "--config",
        str(config),
    ]
    # the layout is refused by config validation, before a process group or megatron-core exists, in
    # the one process the command starts (under torchrun, each worker prints the same line)
    bad = subprocess.run(
        [sys.executable, *cmd[cmd.index("-m", 3) :], "--tensor-model-parallel-size", "3"],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=300,
    )
    assert bad.returncode == 2
    assert (
        "parallel.tensor_model_parallel_size (--tensor-model-parallel-size): 3 does not divide "
        "model.num_attention_heads=2" in bad.stderr
    )
    ok = subprocess.run(
        cmd + ["--tensor-model-parallel-size", "2"], capture_output=True, text=True, env=env, cwd=REPO, timeout=600
    )
    assert ok.returncode == 0, ok.stderr[-3000:]
    lines = [json.loads(l) for l in open(tmp_path / "run" / "metrics.jsonl")]
    assert [l["step"] for l in lines] == [1, 2] and "eval_loss" in lines[-1]
