"""HuggingFace export / import: checkpoints converted to HuggingFace format and back.

Checkpoints come from the real trainer (``Trainer`` + ``Checkpointer``) on real
text (stdlib sources, a SentencePiece BPE trained here): a tiny LoL model
trained a few steps under 1 process and under TP=2 x PP=2 (4 ranks), a FiLM +
input-injection variant and a dense model. Each is exported with
``convert_checkpoint`` and loaded with ``transformers``; the native model
(rebuilt in this process from the same checkpoint) gives the reference logits.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]

EOD_ID = 2  # SentencePiece eos of train_sentencepiece
SEQ = 64
TOL = 1e-4


# ------------------------------------------------------------------ data and training (run in spawned ranks)
def _spm_and_docs(root: str):
    from corpus_fixtures import stdlib_documents, train_sentencepiece

    docs = stdlib_documents(max_bytes=200_000, max_doc=6000)
    model = train_sentencepiece(docs[:-4], os.path.join(root, "sp"), vocab_size=384)
    return model, docs


class TokenRows:
    """Packed rows of EOD-terminated documents (training docs only)."""

    def __init__(self, model: str, docs: list, n: int):
        import sentencepiece as spm

        sp = spm.SentencePieceProcessor(model_file=model)
        stream = []
        for d in docs:
            stream += sp.encode(d[:1500]) + [sp.eos_id()]
            if len(stream) > n * (SEQ + 1):
                break
        t = torch.tensor(stream[: n * (SEQ + 1)])
        self.rows = t.view(n, SEQ + 1)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        row = self.rows[i]
        return {"tokens": row[:-1], "labels": row[1:], "loss_mask": torch.ones(SEQ)}


def _experiment(save: str, tokenizer_model: str, parallel: dict, model: dict):
    from megatron_lol.config import config_from_dict

    m = dict(
        plan="lol",
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=128,
        n_prelude=1,
        n_coda=1,
        num_blocks=4,
        routed_depth=4,
        window_size=8,
        window_shift=4,
        make_vocab_size_divisible_by=64,
        bias_update_speed=0.02,
    )
    m.update(model)
    if m["plan"] != "lol":  # the base's library shape is LoL's own keys
        for key in ("num_blocks", "routed_depth"):
            if key not in model:
                m.pop(key)
    return config_from_dict(
        {
            "model": m,
            "parallel": parallel,
            "data": {"tokenizer_type": "SentencePieceTokenizer", "tokenizer_model": tokenizer_model},
            "training": {
                "train_iters": 3,
                "micro_batch_size": 2,
                "global_batch_size": 4,
                "seq_length": SEQ,
                "log_interval": 100,
                "eval_interval": 100,
                "eval_iters": 0,
                "seed": 11,
                "save": save,
            },
            "optimizer": {"lr": 2e-2, "lr_warmup_iters": 0},
        }
    )


def train_and_save(
    save: str, tokenizer_model: str, parallel: dict, model: dict, steps: int = 3, before_save=None
) -> str:
    """One rank of a training run: ``steps`` optimizer steps, ``before_save(trainer)`` if given (under
    ``torch.no_grad``: tests that move weights where a few steps cannot), then a real checkpoint save."""
    from megatron_lol.data.tokenizers import build_tokenizer
    from megatron_lol.training.checkpointing import Checkpointer
    from megatron_lol.training.trainer import Trainer

    cfg = _experiment(save, tokenizer_model, parallel, model)
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=tokenizer_model)
    _, docs = _spm_and_docs(os.path.dirname(tokenizer_model))
    trainer = Trainer(cfg, tokenizer=tok, datasets=(TokenRows(tokenizer_model, docs[:-4], 16), None, None)).setup()
    data = trainer.data_iterator(trainer.train_ds, 0)
    for _ in range(steps):
        trainer.train_step(data)
    if before_save is not None:
        with torch.no_grad():
            before_save(trainer)
    ckpt = Checkpointer(trainer)
    path = ckpt.save(blocking=True)
    ckpt.close()
    return path


# ------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("convert_corpus")
    model, docs = _spm_and_docs(str(root))
    return {"model": model, "heldout": docs[-4:], "root": root}


def _train(corpus, world: int, jobs: list, script: str = __file__) -> dict:
    """Train and save each ``(name, parallel, model)`` job in turn, in one launch of ``world`` ranks
    (forked as ``srun`` starts them: tests/cli_processes.py); ``script`` is the rank script (default
    this file: ``train_and_save`` per job)."""
    import cli_processes

    saves = {name: corpus["root"] / name for name, _, _ in jobs}
    todo = [
        [str(saves[name]), corpus["model"], par, model]
        for name, par, model in jobs
        if not (saves[name] / "latest_checkpointed_iteration.txt").exists()
    ]
    if todo:
        env = dict(
            os.environ,
            OMP_NUM_THREADS="1",
            PYTHONWARNINGS="ignore",
            PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]),
        )
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(k, None)
        log = corpus["root"] / f"train-{len(list(corpus['root'].glob('train-*.log')))}.log"
        status, out = cli_processes.run_ranks(
            [script, json.dumps(todo)], world, env=env, cwd=REPO, log=log, timeout=600
        )
        assert status == 0, out[-6000:]
    return saves


FILM_VARIANT = dict(
    film="depth_block",
    input_injection=True,
    router_tied=False,
    per_depth_bias=True,
    untie_embeddings_and_output_weights=False,
    window_shift=3,
    routed_depth=5,
    num_blocks=3,
)


@pytest.fixture(scope="module")
def single(corpus):
    """One 1-process launch: the LoL model, a dense model, a FiLM / injection / untied-router variant,
    a depth-only route, router-only tokens."""
    return _train(
        corpus,
        1,
        [
            ("lol_1proc", {}, {}),
            ("dense_1proc", {}, {"plan": "dense", "core_layers": 2}),
            ("lol_film", {}, FILM_VARIANT),
            ("lol_depth_route", {}, dict(router_input="depth")),
            ("lol_router_only", {}, dict(router_only_tokens=[5, 6, 7, 8], router_only_filler=9)),
        ],
    )


@pytest.fixture(scope="module")
def lol_1proc(single):
    return single["lol_1proc"]


@pytest.fixture(scope="module")
def dense_1proc(single):
    return single["dense_1proc"]


@pytest.fixture(scope="module")
def lol_tp2pp2(corpus):
    layout = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}
    return _train(corpus, 4, [("lol_tp2pp2", layout, {})])["lol_tp2pp2"]


# ------------------------------------------------------------------ native reference
def native_model(ckpt_dir: Path):
    """The trained LoLGPTModel rebuilt in this process (TP=1) from the checkpoint."""
    from conftest import ensure_megatron

    ensure_megatron()
    from megatron.core import dist_checkpointing

    from megatron_lol.convert.checkpoint import iteration_dir, read_run_config
    from megatron_lol.model.lol_model import LoLGPTModel

    path, _ = iteration_dir(str(ckpt_dir))
    cfg, info, _ = read_run_config(path, str(ckpt_dir))
    cfg.parallel.tensor_model_parallel_size = cfg.parallel.pipeline_model_parallel_size = 1
    model = LoLGPTModel(cfg.model, cfg.model.vocab_size, info["tokenizer"]["eod_id"])
    state = dist_checkpointing.load(model.sharded_state_dict(prefix="model."), path)
    model.load_state_dict({k[len("model.") :]: v for k, v in state.items() if k.startswith("model.")}, strict=True)
    return model.eval()


def heldout_batch(tokenizer, corpus, rows: int = 2, with_eod: bool = True) -> torch.Tensor:
    out = []
    for doc in corpus["heldout"][:rows]:
        ids = tokenizer(doc[:2000])["input_ids"][:SEQ]
        if with_eod:  # two documents in the row
            ids[SEQ // 3] = EOD_ID
        out.append(ids)
    return torch.tensor(out)


def greedy_native(model, prompt: torch.Tensor, n: int) -> torch.Tensor:
    seq = prompt
    with torch.no_grad():
        for _ in range(n):
            seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return seq


def export(ckpt: Path, out: Path, **kw) -> dict:
    from megatron_lol.convert.to_hf import convert_checkpoint

    return convert_checkpoint(str(ckpt), str(out), force=True, **kw)


def check_lol_export(ckpt: Path, tmp_path: Path, corpus, gen_tokens: int = 32) -> float:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "hf"
    summary = export(ckpt, out, max_shard_size="200KB")
    assert summary["format"] == "lol" and summary["num_shards"] > 1
    files = set(os.listdir(out))
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors.index.json",
        "configuration_lol.py",
        "modeling_lol.py",
        "tokenizer.json",
        "tokenizer_config.json",
    } <= files
    assert all(f.endswith((".json", ".safetensors", ".py", ".model")) for f in files), files
    hf = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=corpus["model"])
    for doc in corpus["heldout"]:
        assert tok(doc[:3000])["input_ids"] == sp.encode(doc[:3000])
    native = native_model(ckpt)
    x = heldout_batch(tok, corpus)
    with torch.no_grad():
        diff = (native(x) - hf(x).logits).abs().max().item()
    assert diff <= TOL, diff
    prompt = x[:1, :12]
    want = greedy_native(native, prompt, gen_tokens)
    got = hf.generate(prompt, max_new_tokens=gen_tokens, min_new_tokens=gen_tokens, do_sample=False)
    assert torch.equal(got, want), (got, want)
    return diff


# ------------------------------------------------------------------ tests
def test_lol_single_process_logits_and_greedy_generation(lol_1proc, tmp_path, corpus):
    diff = check_lol_export(lol_1proc, tmp_path, corpus)
    print(f"lol 1-process: max abs logit diff {diff:.2e}")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_lol_tp2_pp2_logits_and_greedy_generation(lol_tp2pp2, tmp_path, corpus):
    info = json.loads(
        json.dumps(
            __import__("yaml").safe_load(open(next(lol_tp2pp2.glob("iter_*/run_config.yaml"))))["checkpoint"]["layout"]
        )
    )
    assert info["tp"] == 2 and info["pp"] == 2
    diff = check_lol_export(lol_tp2pp2, tmp_path, corpus)
    print(f"lol TP=2 x PP=2: max abs logit diff {diff:.2e}")


@pytest.mark.multiprocess
def test_dense_exports_as_stock_llama_and_round_trips(dense_1proc, tmp_path, corpus):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    from megatron_lol.convert.from_hf import import_hf

    out = tmp_path / "llama"
    assert export(dense_1proc, out)["format"] == "llama"
    conf = json.load(open(out / "config.json"))
    assert conf["model_type"] == "llama" and "auto_map" not in conf
    assert not any(f.endswith(".py") for f in os.listdir(out))
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()  # no remote code
    assert isinstance(hf, LlamaForCausalLM)
    tok = AutoTokenizer.from_pretrained(out)
    x = heldout_batch(tok, corpus, with_eod=False)  # stock Llama attends across EOD: one document per row
    native = native_model(dense_1proc)
    with torch.no_grad():
        diff = (native(x) - hf(x).logits).abs().max().item()
    print(f"dense as Llama: max abs logit diff {diff:.2e}")
    assert diff <= TOL

    ckpt = tmp_path / "imported"
    import_hf(str(out), str(ckpt))
    again = tmp_path / "llama_again"
    export(ckpt, again)

    def tensors(d):
        out = {}
        for f in sorted(os.listdir(d)):
            if f.endswith(".safetensors"):
                out.update(load_file(str(d / f)))
        return out

    a, b = tensors(out), tensors(again)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    # the imported checkpoint is what the trainer loads: same logits natively
    with torch.no_grad():
        assert torch.equal(native_model(ckpt)(x), native(x))


def test_film_injection_untied_variant(single, tmp_path, corpus):
    diff = check_lol_export(single["lol_film"], tmp_path, corpus, gen_tokens=8)
    print(f"lol FiLM/injection/untied router: max abs logit diff {diff:.2e}")


def test_router_only_tokens_variant(single, tmp_path, corpus):
    """Router-only tokens export as such: the remote code's logits and cached greedy decoding equal megatron's."""
    diff = check_lol_export(single["lol_router_only"], tmp_path, corpus, gen_tokens=8)
    conf = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert conf["router_only_tokens"] == [5, 6, 7, 8] and conf["router_only_filler"] == 9
    print(f"lol router-only tokens: max abs logit diff {diff:.2e}")
    # the mode path of held-out text, and generation under it (path forcing with router-only tokens)
    from megatron_lol.cli import main

    jsonl = tmp_path / "heldout.jsonl"
    jsonl.write_text("".join(json.dumps({"text": doc[:2000]}) + "\n" for doc in corpus["heldout"]))
    out = tmp_path / "mode_path"
    argv = ["analyze", "mode-path", "--load", str(single["lol_router_only"]), "--jsonl", str(jsonl)]
    argv += ["--evaluate", "--generate", "The ", "--max-new-tokens", "4", "--output", str(out)]
    assert main(argv) == 0
    mp = json.loads((out / "mode_path.json").read_text())
    assert mp["evaluation"]["forced_loss"] > 0 and len(mp["generation"]["forced_ids"]) > 0


def test_depth_only_route_variant(single, tmp_path, corpus):
    """``router_input: depth`` exports as such: the remote code routes by the depth embedding alone."""
    diff = check_lol_export(single["lol_depth_route"], tmp_path, corpus, gen_tokens=8)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["router_input"] == "depth"
    print(f"lol depth-only route: max abs logit diff {diff:.2e}")


# ------------------------------------------------------------------ failures stop with a clear message
def test_missing_tracker_and_incompatible_config(lol_1proc, tmp_path):
    from megatron_lol.errors import CliError

    broken = tmp_path / "no_tracker"
    shutil.copytree(lol_1proc, broken)
    os.remove(broken / "latest_checkpointed_iteration.txt")
    with pytest.raises(CliError, match="latest_checkpointed_iteration.txt"):
        export(broken, tmp_path / "out1")

    # a run_config.yaml describing another model than the weights
    import yaml

    wrong = tmp_path / "wrong"
    shutil.copytree(lol_1proc, wrong)
    cfg_file = next(wrong.glob("iter_*/run_config.yaml"))
    raw = yaml.safe_load(open(cfg_file))
    raw["model"]["plan"]["num_blocks"] = 5
    yaml.safe_dump(raw, open(cfg_file, "w"))
    with pytest.raises(CliError, match="do not match|missing"):
        export(wrong, tmp_path / "out2")
    assert not (tmp_path / "out2").exists()


def test_truncated_checkpoint_data(lol_1proc, tmp_path):
    from megatron_lol.errors import CliError

    broken = tmp_path / "truncated"
    shutil.copytree(lol_1proc, broken)
    for f in broken.glob("iter_*/__*.distcp"):
        with open(f, "r+b") as fh:
            fh.truncate(os.path.getsize(f) // 2)
    with pytest.raises(CliError, match="corrupted or truncated"):
        export(broken, tmp_path / "out")


def test_truncated_or_corrupted_safetensors_shard_on_import(dense_1proc, tmp_path):
    from megatron_lol.convert.from_hf import import_hf
    from megatron_lol.errors import CliError

    out = tmp_path / "llama"
    export(dense_1proc, out, max_shard_size="100KB")
    shard = sorted(out.glob("model-*.safetensors"))[1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    with pytest.raises(CliError, match=f"{shard.name} is corrupted or truncated"):
        import_hf(str(out), str(tmp_path / "ck1"))
    shard.write_bytes(b"\xff" * 8 + data[8:])
    with pytest.raises(CliError, match="corrupted or truncated"):
        import_hf(str(out), str(tmp_path / "ck2"))


def test_cli_verbs(lol_1proc, tmp_path, capsys, monkeypatch):
    from megatron_lol.cli import main

    monkeypatch.setenv("MEGATRON_LOL_PROGRESS_INTERVAL", "0")  # not a terminal: a progress line per tensor
    assert main(["convert-hf", "--load", str(lol_1proc), "--save", str(tmp_path / "hf"), "--dtype", "bf16"]) == 0
    err = capsys.readouterr().err
    assert "convert-hf: tensor 1 of " in err and "done in" in err, err[-2000:]
    index = json.load(open(tmp_path / "hf" / "model.safetensors.index.json"))
    assert "model.routing.depth_embeddings" in index["weight_map"]
    # an existing non-empty output is not overwritten without --force: one-line error, exit 2
    assert main(["convert-hf", "--load", str(lol_1proc), "--save", str(tmp_path / "hf")]) == 2
    assert main(["convert-hf", "--load", str(tmp_path / "nowhere"), "--save", str(tmp_path / "x")]) == 2


if __name__ == "__main__":  # a rank of _train (tests/cli_processes.py)
    import sys

    for job in json.loads(sys.argv[1]):
        train_and_save(*job)
