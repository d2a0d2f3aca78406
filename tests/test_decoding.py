"""Exact KV-cached decoding (``LoLCache``) of every execution plan, in the HuggingFace export
and in ``megatron-lol generate`` / ``evaluate``.

What is checked:

* every step of cached decoding gives the logits of recomputing the whole prefix (max abs
  difference <= 1e-5 in fp32) and the same greedy token, for 3x the training sequence length
  (windows keep shifting past it), with packed documents and an EOD inside the prompt and
  one forced during decoding: a tiny LoL model trained here (real trainer, checkpoint and
  tokenizer; the export's routes also equal the megatron model's), and models of every plan
  built from real configs with random weights (routers, gates, FiLM spread so every part
  matters; rows of a batch route to different blocks): LoL with FiLM / input injection /
  per-depth routers, LoL with MoE blocks, dense (full, sliding, strided), looped (tied and
  untied attention), Foil and Accordion (two budgets);
* the routed windows' blocks chosen while decoding equal those of the full forward, and the
  windowed part of the cache stays the same size however long the context;
* on the LoL export: ``generate(use_cache=True)`` == ``use_cache=False`` (greedy and sampling
  with a seed, batches of prompts of different lengths with left padding), and
  ``pipeline("text-generation")``;
* the checkpoint loader of ``generate`` / ``evaluate`` gives the megatron model's logits; the
  two verbs' outputs, their references, and their one-line errors.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch

# corpus: the shared fixture, imported so that pytest finds it here by name
from test_convert_hf import EOD_ID, SEQ, _train, corpus, export, heldout_batch, native_model  # noqa: F401
from test_convert_hf_moe import ACCORDION, FOIL

TOL = 1e-5
NEW_TOKENS = 3 * SEQ  # decoding runs to 3x the training sequence length
VOCAB = 384


# ------------------------------------------------------------------ models
ROUTER_SPREAD = 2.0  # three training steps leave the routers near zero: every window picks one block


def train_spread_save(save: str, tokenizer_model: str, parallel: dict, model: dict, steps: int = 3) -> str:
    """``test_convert_hf.train_and_save``, then the window routers are spread before saving, so that
    windows route to different blocks (and routes are worth comparing): random weights, and a
    bias that centres the logits on the mean router input of a training batch."""
    from test_convert_hf import train_and_save

    return train_and_save(save, tokenizer_model, parallel, model, steps, before_save=_spread_routers)


def _spread_routers(trainer) -> None:
    gen = torch.Generator().manual_seed(7)
    for chunk in trainer.model_chunks:
        model = chunk.module
        if not model.plan.routed:
            continue
        inputs = []
        hooks = [
            r.logits.register_forward_hook(lambda mod, args, out: inputs.append(args[0].float()))
            for r in model.core.routers
        ]
        model.eval()
        model(trainer.train_ds.rows[:4, :-1])
        model.train()
        for hook in hooks:
            hook.remove()
        mean = torch.cat(inputs).mean(dim=0)
        for router in model.core.routers:
            weight = router.logits.weight
            weight.copy_(
                torch.randn(weight.shape, generator=gen).to(weight.dtype) * ROUTER_SPREAD / inputs[0].std().item()
            )
            router.logits.bias.copy_(-(weight.float() @ mean).to(weight.dtype))


@pytest.fixture(scope="module")
def checkpoints(corpus):  # noqa: F811
    """One 1-process launch: the tiny LoL model of test_convert_hf (routers spread) and the
    Accordion of test_convert_hf_moe."""
    return _train(corpus, 1, [("lol_1proc", {}, {}), ("accordion", {}, ACCORDION)], script=__file__)


@pytest.fixture(scope="module")
def lol_ckpt(checkpoints):
    return checkpoints["lol_1proc"]


RANDOM_MODELS = {
    "lol_film_injection": dict(
        film="depth_block",
        input_injection=True,
        router_tied=False,
        per_depth_bias=True,
        routed_depth=5,
        num_blocks=3,
        window_shift=3,
    ),
    "lol_depth_route": dict(router_input="depth", router_tied=False),
    # ids 300-339 reach the router only (about a tenth of the random tokens, prompts and generated)
    "lol_router_only": dict(router_only_tokens=list(range(300, 340)), router_only_filler=299, router_tied=False),
    "lol_moe": dict(moe_layers="all", num_experts=4, moe_ffn_hidden_size=48, moe_router_topk=2),
    "dense": dict(plan="dense", core_layers=2),
    "dense_sliding": dict(plan="dense", core_layers=2, dense_attention="sliding"),
    "dense_strided": dict(plan="dense", core_layers=2, dense_attention="strided"),
    "looped": dict(plan="looped", loop_layers=2, loop_count=2),
    "looped_untied": dict(plan="looped", loop_layers=2, loop_count=2, untie_attention=True),
    "foil": FOIL,
    "accordion": ACCORDION,
}


def model_config(model: dict):
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
    )
    m.update(model)
    if m["plan"] != "lol":
        for key in ("num_blocks", "routed_depth"):
            if key not in model:
                m.pop(key)
    return config_from_dict({"model": m, "training": {"seq_length": SEQ}})


def random_model(name: str):
    """The export-side model of a real config, weights drawn so that every part changes the output."""
    from megatron_lol.convert.hf_modeling.configuration_lol import LoLConfig
    from megatron_lol.convert.hf_modeling.modeling_lol import LoLForCausalLM
    from megatron_lol.convert.to_hf import lol_config_json

    cfg = model_config(RANDOM_MODELS[name])
    conf = lol_config_json(cfg, VOCAB, torch.float32, {"eod_id": EOD_ID}, None)
    for key in ("architectures", "model_type", "auto_map", "torch_dtype"):
        conf.pop(key)
    torch.manual_seed(3)
    hf = LoLForCausalLM(LoLConfig(**conf)).eval()
    gen = torch.Generator().manual_seed(5)

    def spread(p, mean, std):
        p.copy_(mean + std * torch.randn(p.shape, generator=gen))

    with torch.no_grad():
        for pname, p in hf.named_parameters():
            if "routing.routers" in pname:
                spread(p, 0.0, 0.5)  # decisive routers: near-ties would make any comparison fragile
            elif "depth_embeddings" in pname or "balancing_bias" in pname or "router_only" in pname:
                spread(p, 0.0, 0.05 if "balancing" in pname else 1.0)
            elif "loop_gates" in pname or "film_gamma" in pname:
                spread(p, 1.0, 0.3)
            elif "film_beta" in pname or "injection_logit" in pname:
                spread(p, 0.0, 0.3)
            elif "embed_tokens" in pname:
                spread(p, 0.0, 0.5)  # token states that differ enough to route differently
    return hf


def prompts_with_documents(batch: int, length: int, seed: int) -> torch.Tensor:
    """Random token rows; row 0 packs two documents (an EOD at a third of the prompt)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(3, VOCAB, (batch, length), generator=gen)
    x[0, length // 3] = EOD_ID
    return x


# ------------------------------------------------------------------ cached decoding == recomputation
def decode_against_recompute(model, prompt: torch.Tensor, steps: int, force_eod_at: int, loop_budget=None):
    """Greedy decoding with a LoLCache; at every step the full recompute of the prefix gives the
    reference logits. Returns (sequence, max abs logit difference, cache, memory per step)."""
    import sys

    LoLCache = sys.modules[type(model).__module__].LoLCache  # an export's remote code has its own copy
    kw = {} if loop_budget is None else {"loop_budget": loop_budget}
    cache = LoLCache(model.config, loop_budget, record_routes=True)
    seq = prompt
    worst, memory = 0.0, []
    with torch.no_grad():
        first = model(prompt, cache=cache, **kw).logits
        worst = (first - model(prompt, **kw).logits).abs().max().item()
        cached = first[:, -1]
        for step in range(steps):
            full = model(seq, **kw).logits[:, -1]
            worst = max(worst, (cached - full).abs().max().item())
            token = cached.argmax(-1)
            assert torch.equal(token, full.argmax(-1)), f"greedy tokens differ at step {step}"
            if step == force_eod_at:
                token = torch.full_like(token, EOD_ID)  # a document ends during decoding
            seq = torch.cat([seq, token.unsqueeze(1)], dim=1)
            cached = model(token.unsqueeze(1), cache=cache, **kw).logits[:, -1]
            memory.append(cache.memory_bytes())
    return seq, worst, cache, memory


def check_routes(model, seq, cache, loop_budget=None):
    """The blocks chosen while decoding are those of the full forward over the final sequence."""
    if not any(step["block"] is None for step in model.config.steps):
        assert cache.routes == []
        return []
    full = []
    with torch.no_grad():
        model(seq, routes=full, **({} if loop_budget is None else {"loop_budget": loop_budget}))
    got, want = sorted(cache.routes), sorted(full)
    assert [r[:6] for r in got] == [r[:6] for r in want]
    assert max(abs(a[6] - b[6]) for a, b in zip(got, want)) <= TOL
    # windows decided during decoding (past the training length too), routed to several blocks
    assert any(r[4] >= 2 * SEQ for r in got) and len({r[5] for r in got}) > 1
    return got


def assert_window_memory_flat(cache, memory):
    windows = {m["windows"] for m in memory}
    assert len(windows) == 1, windows  # the windowed core cache does not grow with the context
    assert memory[-1]["documents"] > memory[0]["documents"]  # document-wide layers do
    for layer in cache.layers:
        if layer.__class__.__name__ == "WindowLayer":
            assert layer.keys.shape[2] == cache_window(cache) and int(layer.length.max()) <= cache_window(cache)


def cache_window(cache) -> int:
    return next(layer.window_size for layer in cache.layers if layer.__class__.__name__ == "WindowLayer")


@pytest.mark.parametrize("name", list(RANDOM_MODELS))
def test_cached_decoding_equals_recompute_every_plan(name):
    model = random_model(name)
    budgets = [1, max(ACCORDION["loop_budgets"])] if name == "accordion" else [None]
    for budget in budgets:
        prompt = prompts_with_documents(3, 20, seed=len(name))
        seq, worst, cache, memory = decode_against_recompute(
            model, prompt, NEW_TOKENS, force_eod_at=SEQ + 5, loop_budget=budget
        )
        print(f"{name} (budget {budget}): {NEW_TOKENS} cached steps, max abs logit diff {worst:.2e}")
        assert worst <= TOL, (name, budget, worst)
        assert seq.shape[1] == 20 + NEW_TOKENS
        check_routes(model, seq, cache, budget)
        steps = model.model.schedule(budget)
        assert len(cache.layers) == 2 + len(steps)
        if any(step["attention"] in ("window", "strided") for step in steps):
            assert_window_memory_flat(cache, memory)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["lol_film_injection", "lol_moe", "accordion"])
def test_cached_decoding_equals_recompute_on_cuda(name):
    """The same check on a CUDA device (fp32, TF32 off): every tensor of the cache lives there."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = random_model(name).cuda()
    prompt = prompts_with_documents(3, 20, seed=len(name)).cuda()
    budget = 1 if name == "accordion" else None
    seq, worst, cache, _ = decode_against_recompute(model, prompt, NEW_TOKENS, force_eod_at=SEQ, loop_budget=budget)
    assert worst <= 1e-4, worst
    check_routes(model, seq, cache, budget)
    assert all(layer.keys.is_cuda for layer in cache.layers if layer.keys is not None)


def test_trained_lol_cached_decoding_and_routes_equal_megatron(lol_ckpt, corpus, tmp_path):  # noqa: F811
    """The trained LoL model's export: packed documents with an EOD inside the prompt; routes
    chosen while decoding are those of the full forward and of the megatron model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_lol.model.windows import DocumentLayout

    export(lol_ckpt, tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf", trust_remote_code=True)
    prompt = heldout_batch(tok, corpus)[:, :30]  # an EOD at position SEQ // 3 of each row
    assert (prompt == EOD_ID).any(dim=1).all()
    seq, worst, cache, memory = decode_against_recompute(hf, prompt, NEW_TOKENS, force_eod_at=SEQ)
    print(f"trained lol: {NEW_TOKENS} cached steps, max abs logit diff {worst:.2e}")
    assert worst <= TOL
    routes = check_routes(hf, seq, cache)
    assert_window_memory_flat(cache, memory)
    # the megatron model routes the same windows to the same blocks
    native = native_model(lol_ckpt)
    with torch.no_grad():
        _, core = native(seq, record=True, return_core=True)
    first_doc = DocumentLayout.from_tokens(seq, EOD_ID).doc_index[:, 0].tolist()
    want = []
    for rec in core.records:
        for doc, ordinal, block in zip(rec.window_doc.tolist(), rec.window_ordinal.tolist(), rec.choice.tolist()):
            row = max(r for r, d in enumerate(first_doc) if d <= doc)
            want.append((row, rec.depth, doc - first_doc[row], ordinal, block))
    assert sorted(want) == sorted((r[0], r[1], r[2], r[3], r[5]) for r in routes)
    assert len({r[5] for r in routes}) > 1  # the trained routers do not send everything to one block


# ------------------------------------------------------------------ transformers generate / pipeline
def _greedy(hf, ids, n, **kw):
    return hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, **kw)


def test_hf_generate_cache_batches_sampling_and_pipeline(lol_ckpt, corpus, tmp_path):  # noqa: F811
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    out_dir = tmp_path / "hf"
    export(lol_ckpt, out_dir)
    assert {"cache_lol.py", "layers_lol.py", "decoding_lol.py", "modeling_lol.py"} <= set(os.listdir(out_dir))
    assert json.load(open(out_dir / "config.json"))["use_cache"] is True
    assert json.load(open(out_dir / "generation_config.json"))["use_cache"] is True
    hf = AutoModelForCausalLM.from_pretrained(out_dir, trust_remote_code=True, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(out_dir, trust_remote_code=True)
    x = heldout_batch(tok, corpus)
    prompt = x[:1, :30]
    # greedy: the cached generation is the recomputed one, logits included
    a = hf.generate(
        prompt,
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
        return_dict_in_generate=True,
        output_logits=True,
    )
    b = hf.generate(
        prompt,
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
        use_cache=False,
        return_dict_in_generate=True,
        output_logits=True,
    )
    assert torch.equal(a.sequences, b.sequences)
    assert max((p - q).abs().max().item() for p, q in zip(a.logits, b.logits)) <= TOL
    cache = a.cache
    assert type(cache).__name__ == "LoLCache" and cache.get_seq_length() == 30 + NEW_TOKENS - 1
    # batches of prompts of different lengths (left padding): each row as generated alone
    rows = [x[0, :9], x[1, :30], x[0, 15:40]]  # x[0, 21] is an EOD: the third prompt holds two documents
    width = max(len(r) for r in rows)
    batch = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(batch)
    for i, r in enumerate(rows):
        batch[i, width - len(r) :], mask[i, width - len(r) :] = r, 1
    got = _greedy(hf, batch, 40, attention_mask=mask, pad_token_id=0)
    assert torch.equal(got, _greedy(hf, batch, 40, attention_mask=mask, pad_token_id=0, use_cache=False))
    for i, r in enumerate(rows):
        assert torch.equal(got[i, width:], _greedy(hf, r.unsqueeze(0), 40)[0, len(r) :]), i
    # the same with the tokenizer's left padding (docs/evaluation.md)
    tok.padding_side, tok.pad_token = "left", tok.unk_token
    texts = [tok.decode(r) for r in rows[:2]]
    enc = tok(texts, return_tensors="pt", padding=True)
    padded = _greedy(hf, enc["input_ids"], 24, attention_mask=enc["attention_mask"], pad_token_id=tok.pad_token_id)
    for i, t in enumerate(texts):
        alone = tok(t, return_tensors="pt")["input_ids"]
        assert torch.equal(padded[i, enc["input_ids"].shape[1] :], _greedy(hf, alone, 24)[0, alone.shape[1] :]), i
    # sampling with a seed: the same draw with and without the cache; another seed draws otherwise
    sampled = {}
    for seed, use_cache in ((7, True), (7, False), (8, True)):
        torch.manual_seed(seed)
        sampled[seed, use_cache] = hf.generate(
            batch,
            attention_mask=mask,
            pad_token_id=0,
            do_sample=True,
            max_new_tokens=48,
            min_new_tokens=48,
            top_k=50,
            top_p=0.95,
            temperature=1.5,
            use_cache=use_cache,
        )
    assert torch.equal(sampled[7, True], sampled[7, False])
    assert not torch.equal(sampled[7, True], sampled[8, True])
    # pipeline("text-generation") on the export directory
    pipe = pipeline("text-generation", model=str(out_dir), trust_remote_code=True, dtype=torch.float32)
    text = tok.decode(x[1, :30])
    ids = tok(text, return_tensors="pt")["input_ids"]
    want = hf.generate(ids, max_new_tokens=20, do_sample=False)[0]
    result = pipe(text, max_new_tokens=20, do_sample=False)[0]["generated_text"]
    assert result.startswith(text) and len(result) > len(text)
    tokens = pipe(text, max_new_tokens=20, do_sample=False, return_tensors=True)[0]["generated_token_ids"]
    assert list(tokens) == want.tolist()


# ------------------------------------------------------------------ megatron-lol generate / evaluate
def test_checkpoint_model_equals_megatron_forward(lol_ckpt, corpus):  # noqa: F811
    """The loader of generate / evaluate maps the checkpoint to the cached model: same logits as the
    megatron model's forward, and cached greedy decoding gives the megatron model's tokens."""
    from megatron_lol.inference.loading import load_model, load_tokenizer

    loaded = load_model(str(lol_ckpt))
    tok = load_tokenizer(loaded)
    assert loaded.eod_id == EOD_ID and tok.eod == EOD_ID
    native = native_model(lol_ckpt)
    rows = [tok.tokenize(doc[:2000])[:SEQ] for doc in corpus["heldout"][:2]]
    x = torch.tensor(rows)
    x[:, SEQ // 3] = EOD_ID
    with torch.no_grad():
        diff = (native(x) - loaded.model(x).logits).abs().max().item()
        assert diff <= 1e-4, diff
        seq = x[:1, :12]
        for _ in range(24):
            seq = torch.cat([seq, native(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    got = loaded.model.generate(x[:1, :12], max_new_tokens=24, min_new_tokens=24, do_sample=False)
    assert torch.equal(got, seq)


def _cli(capsys, *argv):
    from megatron_lol.cli import main

    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_cli(lol_ckpt, corpus, tmp_path, capsys):  # noqa: F811
    from megatron_lol.inference.loading import load_model

    loaded = load_model(str(lol_ckpt))
    texts = [corpus["heldout"][0][:60], corpus["heldout"][1][:45], corpus["heldout"][2][:20]]
    code, out, err = _cli(
        capsys,
        "generate",
        "--load",
        str(lol_ckpt),
        "--prompt",
        texts[0],
        "--max-new-tokens",
        "20",
        "--json",
        "--record-routes",
        "--ignore-eod",
    )
    assert code == 0, err
    result = json.loads(out)
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=corpus["model"])
    prompt = torch.tensor([sp.encode(texts[0])])
    assert result["prompt_tokens"] == prompt.shape[1]
    want = loaded.model.generate(prompt, max_new_tokens=20, min_new_tokens=20, do_sample=False)[0, prompt.shape[1] :]
    assert result["tokens"] == want.tolist() and result["completion_tokens"] == 20
    # routes: every routed depth, every window of prompt and completion, starting at position 0
    depths = {r["depth"] for r in result["routes"]}
    assert depths == set(range(1, 5))
    routes = []
    with torch.no_grad():
        loaded.model(torch.cat([prompt, want.unsqueeze(0)], dim=1)[:, :-1], routes=routes)
    assert sorted((r["depth"], r["document"], r["window"], r["start"], r["block"]) for r in result["routes"]) == sorted(
        r[1:6] for r in routes
    )
    assert "tokens/s" in err
    # a batch of prompts of different lengths decodes each as alone; sampling repeats with its seed
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    args = [
        "generate",
        "--load",
        str(lol_ckpt),
        "--prompts",
        str(prompts),
        "--max-new-tokens",
        "12",
        "--json",
        "--batch-size",
        "2",
    ]
    code, out, err = _cli(capsys, *args)
    assert code == 0, err
    batched = [json.loads(line) for line in out.splitlines()]
    assert [r["index"] for r in batched] == [0, 1, 2]
    for t, r in zip(texts, batched):
        code, out, _ = _cli(
            capsys, "generate", "--load", str(lol_ckpt), "--prompt", t, "--max-new-tokens", "12", "--json"
        )
        assert json.loads(out)["tokens"] == r["tokens"]
    draws = [
        _cli(capsys, *args, "--temperature", "1.2", "--top-k", "40", "--top-p", "0.9", "--seed", s)[1]
        for s in ("3", "3", "4")
    ]
    assert draws[0] == draws[1] and draws[0] != draws[2]
    # text output
    code, out, _ = _cli(
        capsys, "generate", "--load", str(lol_ckpt), "--prompt", texts[2], "--max-new-tokens", "5", "--record-routes"
    )
    assert code == 0 and out.startswith("=== 0:") and "routes depth 1 document 0:" in out


def test_generate_and_evaluate_errors(lol_ckpt, tmp_path, capsys):
    missing = tmp_path / "nowhere"
    for verb, source in (("generate", ["--prompt", "hi"]), ("evaluate", ["--jsonl", str(tmp_path / "x.jsonl")])):
        code, _, err = _cli(capsys, verb, "--load", str(missing), *source)
        assert code == 2 and err.strip() == f"megatron-lol {verb}: error: checkpoint directory {missing} does not exist"
    # the tokenizer is gone (no copy in the checkpoint, the run's path moved away)
    broken = tmp_path / "no_tokenizer"
    shutil.copytree(lol_ckpt, broken)
    for d in broken.glob("iter_*/tokenizer"):
        shutil.rmtree(d)
    cfg_file = next(broken.glob("iter_*/run_config.yaml"))
    import yaml

    raw = yaml.safe_load(open(cfg_file))
    raw["data"]["tokenizer_model"] = str(tmp_path / "gone.model")
    yaml.safe_dump(raw, open(cfg_file, "w"))
    code, _, err = _cli(capsys, "generate", "--load", str(broken), "--prompt", "hi")
    assert code == 2 and "the tokenizer is missing" in err and "gone.model" in err and len(err.splitlines()) == 1
    code, _, err = _cli(capsys, "evaluate", "--load", str(broken), "--jsonl", str(tmp_path / "x.jsonl"))
    assert code == 2 and "the tokenizer is missing" in err
    # prompts: too long, empty, bad JSONL line; routes of a model without routing
    code, _, err = _cli(capsys, "generate", "--load", str(lol_ckpt), "--prompt", "word " * 100)
    assert code == 2 and "more than the model allows (64" in err
    code, _, err = _cli(
        capsys, "generate", "--load", str(lol_ckpt), "--prompt", "hello there", "--max-prompt-tokens", "1"
    )
    assert code == 2 and "more than the model allows (1" in err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"text": 3}\n')
    code, _, err = _cli(capsys, "generate", "--load", str(lol_ckpt), "--prompts", str(bad))
    assert code == 2 and f"--prompts {bad} line 2: no 'prompt' (or 'text') string" in err
    code, _, err = _cli(capsys, "generate", "--load", str(lol_ckpt), "--prompt", "hi", "--top-p", "0")
    assert code == 2 and "--top-p" in err
    code, _, err = _cli(capsys, "evaluate", "--load", str(lol_ckpt), "--data-path", str(tmp_path / "none"))
    assert code == 2 and f"{tmp_path / 'none'}.bin does not exist" in err
    code, _, err = _cli(capsys, "evaluate", "--load", str(lol_ckpt), "--jsonl", str(bad), "--length-buckets", "5,2")
    assert code == 2 and "--length-buckets" in err


def _reference_nll(native, tokens: list, seq: int) -> float:
    """The megatron model's summed NLL of a document scored after an EOD, ``seq`` predictions per
    piece, each conditioned on the ``seq`` tokens before its last prediction."""
    ids = [EOD_ID] + tokens
    total = 0.0
    with torch.no_grad():
        for start in range(0, len(tokens), seq):
            end = min(start + seq, len(tokens))
            inputs = torch.tensor([ids[max(0, end - seq) : end]])
            logits = native(inputs)[0, start - end :].float()
            total += torch.nn.functional.cross_entropy(
                logits, torch.tensor(ids[start + 1 : end + 1]), reduction="sum"
            ).item()
    return total


def test_evaluate_cli_jsonl_and_indexed_dataset(lol_ckpt, corpus, tmp_path, capsys):  # noqa: F811
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=corpus["model"])
    texts = [corpus["heldout"][0][:300], corpus["heldout"][1][:1200], corpus["heldout"][2][:80]]
    data = tmp_path / "heldout.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    docs = [sp.encode(t) for t in texts]
    short, middle, long = sorted(len(d) for d in docs)
    assert short < middle < long and long > SEQ  # the long document is scored in several pieces
    edges = [short + 1, middle + 1]  # one document per length bucket
    code, out, err = _cli(
        capsys,
        "evaluate",
        "--load",
        str(lol_ckpt),
        "--jsonl",
        str(data),
        "--json",
        "--length-buckets",
        f"{edges[0]},{edges[1]}",
    )
    assert code == 0, err
    result = json.loads(out)
    assert "evaluate" in err  # the progress bar
    native = native_model(lol_ckpt)
    nll = [_reference_nll(native, d, SEQ) for d in docs]
    tokens, nbytes = sum(len(d) for d in docs), sum(len(t.encode()) for t in texts)
    overall = result["overall"]
    assert overall["documents"] == 3 and overall["tokens"] == tokens and overall["bytes"] == nbytes
    assert math.isclose(overall["loss"], sum(nll) / tokens, rel_tol=1e-5)
    assert math.isclose(overall["perplexity"], math.exp(sum(nll) / tokens), rel_tol=1e-5)
    assert math.isclose(overall["bits_per_byte"], sum(nll) / (math.log(2) * nbytes), rel_tol=1e-5)
    names = {short: f"< {edges[0]}", middle: f"{edges[0]}-{edges[1] - 1}", long: f">= {edges[1]}"}
    buckets = {b["bucket"]: b for b in result["buckets"]}
    assert set(buckets) == set(names.values())
    for d, value in zip(docs, nll):
        bucket = buckets[names[len(d)]]
        assert bucket["documents"] == 1 and math.isclose(bucket["loss"], value / len(d), rel_tol=1e-5)
    # the same documents as a Megatron indexed dataset (preprocess appends EOD): the same scores
    from megatron_lol.cli import main

    prefix = tmp_path / "heldout"
    assert (
        main(
            [
                "preprocess",
                "--input",
                str(data),
                "--output-prefix",
                str(prefix),
                "--tokenizer-type",
                "SentencePieceTokenizer",
                "--tokenizer-model",
                corpus["model"],
                "--append-eod",
                "--workers",
                "1",
            ]
        )
        == 0
    )
    capsys.readouterr()
    files = list(tmp_path.glob("heldout*.idx"))
    code, out, err = _cli(
        capsys,
        "evaluate",
        "--load",
        str(lol_ckpt),
        "--data-path",
        str(files[0])[:-4],
        "--json",
        "--no-progress",
        "--micro-batch-size",
        "1",
    )
    assert code == 0, err
    indexed = json.loads(out)
    assert indexed["overall"]["tokens"] == tokens and "evaluate" not in err
    assert math.isclose(indexed["overall"]["loss"], overall["loss"], rel_tol=1e-6)
    # the table
    code, out, _ = _cli(
        capsys, "evaluate", "--load", str(lol_ckpt), "--jsonl", str(data), "--no-progress", "--max-documents", "1"
    )
    assert code == 0 and "bpb" in out and out.splitlines()[2].split()[:2] == ["all", "1"]


def test_generate_and_evaluate_accordion_budget(checkpoints, corpus, tmp_path, capsys):  # noqa: F811
    """--loop-budget: generate's tokens are the megatron model's greedy tokens at that budget, and
    evaluate's loss changes with it."""
    import sentencepiece as spm

    ckpt = checkpoints["accordion"]
    sp = spm.SentencePieceProcessor(model_file=corpus["model"])
    text = corpus["heldout"][0][:50]
    native = native_model(ckpt)
    for budget in (1, 3):
        code, out, err = _cli(
            capsys,
            "generate",
            "--load",
            str(ckpt),
            "--prompt",
            text,
            "--max-new-tokens",
            "12",
            "--loop-budget",
            str(budget),
            "--json",
            "--ignore-eod",
        )
        assert code == 0, err
        seq = torch.tensor([sp.encode(text)])
        with torch.no_grad():
            for _ in range(12):
                seq = torch.cat([seq, native(seq, budget=budget)[:, -1].argmax(-1, keepdim=True)], dim=1)
        assert json.loads(out)["tokens"] == seq[0, -12:].tolist(), budget
    data = tmp_path / "heldout.jsonl"
    data.write_text(json.dumps({"text": corpus["heldout"][1][:400]}) + "\n")
    losses = {}
    for budget in (0, 3):
        code, out, err = _cli(
            capsys,
            "evaluate",
            "--load",
            str(ckpt),
            "--jsonl",
            str(data),
            "--json",
            "--no-progress",
            "--loop-budget",
            str(budget),
        )
        assert code == 0, err
        losses[budget] = json.loads(out)["overall"]["loss"]
        assert json.loads(out)["loop_budget"] == budget
    assert losses[0] != losses[3]
    code, _, err = _cli(capsys, "generate", "--load", str(ckpt), "--prompt", "hi", "--loop-budget", "2")
    assert code == 2 and "--loop-budget: 2 is not one of the model's budgets [0, 1, 3]" in err
    code, _, err = _cli(
        capsys, "generate", "--load", str(checkpoints["lol_1proc"]), "--prompt", "hi", "--loop-budget", "1"
    )
    assert code == 2 and "only plan accordion has a loop budget" in err
    code, _, err = _cli(capsys, "generate", "--load", str(ckpt), "--prompt", "hi", "--record-routes")
    assert code == 2 and "--record-routes: plan accordion has no routed depths" in err


def test_decode_benchmark_runs(tmp_path):
    """bench/decode.py at tiny sizes: every model, batch and length gets its row, measured and
    estimated recomputation, and the windowed LoL cache does not grow with the length."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "decode.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(root / "bench" / "decode.py"),
            "--hidden",
            "32",
            "--ffn",
            "64",
            "--vocab",
            "256",
            "--window",
            "8",
            "--shift",
            "4",
            "--prompt",
            "8",
            "--new-tokens",
            "8,24",
            "--batch",
            "1,2",
            "--repeats",
            "1",
            "--recompute-limit",
            "8",
            "--estimate-points",
            "3",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=root,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert sorted((r["model"], r["batch"], r["new_tokens"]) for r in rows) == sorted(
        (m, b, n) for m in ("lol", "dense", "accordion") for b in (1, 2) for n in (8, 24)
    )
    for r in rows:
        assert r["layers"] == 6 and r["cached_tokens_per_s"] > 0 and r["recompute_estimate_tokens_per_s"] > 0
        assert (r["recompute_tokens_per_s"] is not None) == (r["new_tokens"] == 8)
    lol = {(r["batch"], r["new_tokens"]): r["cache_bytes"] for r in rows if r["model"] == "lol"}
    for b in (1, 2):
        assert lol[b, 8]["windows"] == lol[b, 24]["windows"] > 0 and lol[b, 24]["documents"] > lol[b, 8]["documents"]
    assert all(r["cache_bytes"]["windows"] == 0 for r in rows if r["model"] != "lol")
    assert "vs dense" in proc.stdout and proc.stdout.count("\nlol ") == 4


# ------------------------------------------------------------------ lm-evaluation-harness on the export
ARC = [
    ("What does the def keyword start?", ["a function", "a number", "a colour"], 0),
    ("Which word imports a module?", ["import", "banana", "seventeen"], 0),
    ("What does return give back?", ["a value", "a river", "a song"], 0),
    ("Which of these is a Python type?", ["dict", "cloud", "spoon"], 0),
    ("What closes a string that opens with a quote?", ["a quote", "a tree", "a door"], 0),
    ("Which symbol starts a comment?", ["#", "apple", "tiger"], 0),
]


def _arc_loglikelihoods(hf, tok, question: str, choices: list) -> list:
    """lm-evaluation-harness's multiple-choice scoring, computed here: the log-likelihood of
    ' ' + choice after 'Question: ...\nAnswer:' (the pair encoded as a whole, the context alone)."""
    context = f"Question: {question}\nAnswer:"
    out = []
    for choice in choices:
        whole = tok(context + " " + choice, add_special_tokens=False)["input_ids"]
        ctx = tok(context, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            logits = hf(torch.tensor([whole[:-1]])).logits[0].float().log_softmax(-1)
        cont = torch.tensor(whole[len(ctx) :])
        out.append(logits[len(ctx) - 1 :].gather(1, cont.unsqueeze(1)).sum().item())
    return out


def test_lm_evaluation_harness_local_tasks(lol_ckpt, corpus, tmp_path, capsys):  # noqa: F811
    """docs/evaluation.md's recipe: lm_eval --model hf on the export, offline, with the task files of
    examples/lm_eval_tasks reading local JSONL data. Its bits per byte of held-out documents is
    megatron-lol evaluate's; its ARC accuracy is the one computed here."""
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM, AutoTokenizer

    export(lol_ckpt, tmp_path / "hf")
    work = tmp_path / "lm_eval"
    shutil.copytree(Path(__file__).resolve().parents[1] / "examples" / "lm_eval_tasks", work)
    heldout = [corpus["heldout"][0][:300], corpus["heldout"][1][:900], corpus["heldout"][2][:80]]
    data = {
        "arc_easy": [
            {"id": str(i), "question": q, "choices": {"text": c, "label": ["A", "B", "C"]}, "answerKey": "ABC"[a]}
            for i, (q, c, a) in enumerate(ARC)
        ],
        "lambada_openai": [{"text": t[:120].rsplit(" ", 1)[0]} for t in heldout],
        "heldout": [{"text": t} for t in heldout],
        "wikitext": [{"page": " = Heading = \n " + t[:200].replace(". ", " . ") + " \n"} for t in heldout],
    }
    for name, rows in data.items():
        (work / "data" / name).mkdir(parents=True)
        for split in ("train", "validation", "test"):
            (work / "data" / name / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = dict(
        os.environ,
        HF_DATASETS_OFFLINE="1",
        HF_HUB_OFFLINE="1",
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]),
    )
    cmd = [
        sys.executable,
        "-m",
        "lm_eval",
        "--model",
        "hf",
        "--model_args",
        f"pretrained={tmp_path / 'hf'},trust_remote_code=True,dtype=float32,prefix_token_id={EOD_ID}",
        "--tasks",
        "arc_easy_local,lambada_openai_local,heldout_text_local,wikitext_local",
        "--include_path",
        ".",
        "--device",
        "cpu",
        "--batch_size",
        "4",
        "--output_path",
        "results",
    ]
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(next((work / "results").rglob("results_*.json")).read_text())["results"]
    # held-out documents: lm-eval's rolling log-likelihood is megatron-lol evaluate's
    (tmp_path / "heldout.jsonl").write_text((work / "data" / "heldout" / "test.jsonl").read_text())
    code, out, err = _cli(
        capsys,
        "evaluate",
        "--load",
        str(lol_ckpt),
        "--jsonl",
        str(tmp_path / "heldout.jsonl"),
        "--json",
        "--no-progress",
    )
    assert code == 0, err
    ours = json.loads(out)["overall"]
    assert math.isclose(results["heldout_text_local"]["bits_per_byte,none"], ours["bits_per_byte"], rel_tol=1e-5)
    # ARC-format multiple choice: the accuracy of the log-likelihoods computed here
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf", trust_remote_code=True)
    correct = [
        max(range(3), key=lambda i: ll[i]) == a
        for (q, c, a), ll in ((item, _arc_loglikelihoods(hf, tok, item[0], item[1])) for item in ARC)
    ]
    assert results["arc_easy_local"]["acc,none"] == pytest.approx(sum(correct) / len(ARC))
    assert math.isfinite(results["lambada_openai_local"]["perplexity,none"])
    assert 0 <= results["lambada_openai_local"]["acc,none"] <= 1
    assert math.isfinite(results["wikitext_local"]["bits_per_byte,none"])


if __name__ == "__main__":  # a rank of the lol_ckpt launch (torch.distributed.run)
    import sys

    for job in json.loads(sys.argv[1]):
        train_spread_save(*job)


def test_evaluate_part_reads_the_split_as_training_does(tmp_path):
    """``evaluate --part`` takes the documents of the run's split that ``analyze --part`` takes (megatron-core's
    ranges); without it, a prefix the run trained on is scored on its valid part, any other prefix whole."""
    import argparse
    from types import SimpleNamespace

    from corpus_fixtures import write_tiny_dataset, write_tiny_tokenizer

    from megatron_lol.analysis.loading import read_indexed
    from megatron_lol.data.tokenizers import build_tokenizer
    from megatron_lol.errors import CliError
    from megatron_lol.inference import evaluate

    prefix = write_tiny_dataset(tmp_path / "corpus", documents=50)
    tok = build_tokenizer("HuggingFaceTokenizer", str(write_tiny_tokenizer(tmp_path / "tok")))
    split = "80,12,8"
    for part, count in (("train", 40), ("valid", 6), ("test", 4), ("all", 50)):
        docs = [t for t, _ in evaluate.indexed_documents(prefix, tok, 0, None, part, split)]
        assert len(docs) == count
        assert [d + [0] for d in docs] == read_indexed(prefix, part, split, max_examples=100)
    with pytest.raises(CliError, match=r"the test part of split '90,10,0' holds none of its 50 sequences"):
        list(evaluate.indexed_documents(prefix, tok, 0, None, "test", "90,10,0"))
    parser = argparse.ArgumentParser()
    evaluate.add_arguments(parser)
    args = parser.parse_args(["--load", "x", "--data-path", prefix])
    run = SimpleNamespace(data=SimpleNamespace(paths=[str(tmp_path / "." / "corpus")], split=split))
    assert args.part is None and evaluate.data_part(args, run) == "valid"
    assert evaluate.data_part(args, SimpleNamespace(data=SimpleNamespace(paths=["1", "other"]))) == "all"
    args = parser.parse_args(["--load", "x", "--data-path", prefix, "--part", "train"])
    assert evaluate.data_part(args, run) == "train"


def test_generate_prefill_builds_no_host_layout(monkeypatch):
    """``megatron-lol generate`` decodes with the plain-PyTorch model (``LoLForCausalLM``), whose windows
    are its own (:mod:`~megatron_lol.convert.hf_modeling.modeling_lol`): its prefill never reaches the
    training core's host layout (built with the batch there, or by ``Core._layout`` from a forward
    given none, a copy of the documents to the host). What the prefill does read back is that model's
    routing (group sizes, window starts), counted here by kind."""
    import argparse

    from megatron_lol.inference.generate import generate_batch
    from megatron_lol.model import core, host_layout
    from megatron_lol.perf.op_count import OpCounter

    def no_layout(*args, **kwargs):
        raise AssertionError("generate built a host layout")

    for module, name in ((host_layout, "build_host_layout"), (host_layout, "layout_from_documents")):
        monkeypatch.setattr(module, name, no_layout)
    monkeypatch.setattr(core.Core, "_layout", no_layout)
    model = random_model("lol_film_injection")
    prompts = [p.tolist() for p in prompts_with_documents(2, 24, 1)]
    args = argparse.Namespace(max_new_tokens=1, temperature=0.0, ignore_eod=True, record_routes=False)
    with OpCounter() as count:
        (new, _), _ = generate_batch(model, prompts, args, EOD_ID, None)
    assert len(new) == 1
    assert count.sync_names.get("cpu", 0) == 1, count.sync_names  # the generated ids, after decoding
    assert set(count.sync_names) <= {
        "cpu",
        "nonzero",
        "bincount",
        "_local_scalar_dense",
        "_unique2",
        "tolist",
        "index (boolean mask)",
    }, count.sync_names
