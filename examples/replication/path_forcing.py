"""The path-forcing study's task: strategies that share one output vocabulary, named by a router-only field.

Every example is a strategy token, a prompt of digits, a separator and the prompt transformed by
that strategy::

    <rev> 3 9 1 4 7 2 <sep> 2 7 4 1 9 3

The strategy comes first, so every window's route may depend on it (a window's route reads the
tokens up to its first token).

The strategy tokens are the model's ``router_only_tokens`` (docs/model.md, "Router-only
tokens"): only the router sees which strategy is asked for, the layers see ``<filler>``. After
training, the mode path of each strategy's validation examples (teacher-forced, docs/model.md,
"Path forcing") is forced on fresh prompts whose strategy slot holds the filler, and the
greedy continuation is classified by which strategy's output it equals: the paper's forcing
study in miniature (its mazes: strategies that differ in order, not in vocabulary).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

DIGITS = [str(d) for d in range(10)]
STRATEGIES = {
    "<copy>": lambda xs: list(xs),
    "<rev>": lambda xs: list(reversed(xs)),
    "<inc>": lambda xs: [str((int(x) + 1) % 10) for x in xs],
    "<rot>": lambda xs: list(xs[1:]) + [xs[0]],
}
SPECIALS = ["<unk>", "</s>", "<sep>", "<filler>"]
PROMPT_DIGITS = 6


def vocabulary() -> list:
    return SPECIALS + DIGITS + list(STRATEGIES)


def token_id(token: str) -> int:
    return vocabulary().index(token)


def distinct_prompt(rng: random.Random) -> list:
    """Digits whose four strategy outputs differ pairwise, so an output names its strategy."""
    while True:
        xs = [rng.choice(DIGITS) for _ in range(PROMPT_DIGITS)]
        outs = {tuple(f(xs)) for f in STRATEGIES.values()}
        if len(outs) == len(STRATEGIES):
            return xs


def example(xs: list, strategy: str) -> str:
    return " ".join([strategy] + xs + ["<sep>"] + STRATEGIES[strategy](xs))


def write_tokenizer(directory: Path) -> Path:
    """A word-level HF tokenizer over the task's vocabulary (``</s>`` is the end of document)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(vocabulary())}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    return directory


def build_task(out: Path, examples: int, seed: int) -> dict:
    """Tokenizer, a JSONL corpus (one example per document, strategies balanced) and its indexed dataset."""
    rng = random.Random(seed)
    tokenizer = write_tokenizer(out / "tokenizer")
    corpus = out / "strategies.jsonl"
    names = list(STRATEGIES)
    with open(corpus, "w") as f:
        for i in range(examples):
            strategy = names[i % len(names)]
            f.write(json.dumps({"text": example(distinct_prompt(rng), strategy), "strategy": strategy}) + "\n")
    prefix = out / "strategies"
    cmd = [sys.executable, "-m", "megatron_lol", "preprocess", "--input", str(corpus), "--output-prefix", str(prefix)]
    cmd += ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tokenizer), "--append-eod"]
    cmd += ["--workers", "1", "--no-progress"]
    for stale in out.glob("strategies_text_document.*"):
        stale.unlink()  # a rerun writes the corpus afresh (preprocess refuses to overwrite)
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"replicate: preprocess of {corpus} failed: {proc.stderr.strip()}")
    return {
        "data.paths": f"[{prefix}_text_document]",
        "data.split": '"95,5,0"',
        "data.tokenizer_type": "HuggingFaceTokenizer",
        "data.tokenizer_model": str(tokenizer),
        "data.cache_dir": str(out / "cache"),
        "model.plan.routing.router_only_tokens": "[" + ",".join(str(token_id(s)) for s in STRATEGIES) + "]",
        "model.plan.routing.router_only_filler": token_id("<filler>"),
    }


def evaluate(save: Path, prompts: int, seed: int) -> dict:
    """Per strategy: the mode path of teacher-forced validation examples; then on fresh prompts with the
    filler in the strategy slot, the strategy each forced path produces (a confusion matrix), and as a
    reference the accuracy with the strategy token itself, routed."""
    import torch

    from megatron_lol.analysis.loading import load_checkpoint
    from megatron_lol.analysis.routing import collect_routes, forced_path, greedy_generate, mode_path

    torch.set_num_threads(1)
    ckpt = load_checkpoint(str(save))
    ids = {tok: i for i, tok in enumerate(vocabulary())}
    rng = random.Random(seed)
    names = list(STRATEGIES)
    seq = ckpt.cfg.training.seq_length

    def encode(words: list) -> list:
        return [ids[w] for w in words]

    paths = {}
    for strategy in names:
        examples = [encode(example(distinct_prompt(rng), strategy).split()) for _ in range(prompts)]
        routes = collect_routes(ckpt.model, examples, seq, ckpt.eod_id)
        paths[strategy] = mode_path(routes)

    def produced(xs: list, out: list) -> str:
        vocab = vocabulary()
        words = [vocab[t] if t < len(vocab) else "<unk>" for t in out[:PROMPT_DIGITS]]  # padded rows
        return next((s for s in names if STRATEGIES[s](xs) == words), "none")

    confusion = {s: {t: 0 for t in names + ["none"]} for s in names}
    routed_correct = {s: 0 for s in names}
    for _ in range(prompts):
        xs = distinct_prompt(rng)
        for strategy in names:
            out = greedy_generate(ckpt.model, encode([strategy] + xs + ["<sep>"]), PROMPT_DIGITS, ckpt.eod_id)
            routed_correct[strategy] += produced(xs, out) == strategy
            path_ids, gates = paths[strategy]
            forced = forced_path(path_ids, gates)
            prompt = encode(["<filler>"] + xs + ["<sep>"])
            out = greedy_generate(ckpt.model, prompt, PROMPT_DIGITS, ckpt.eod_id, forced)
            confusion[strategy][produced(xs, out)] += 1
    return {
        "prompts": prompts,
        "routed_accuracy": {s: routed_correct[s] / prompts for s in names},
        "forced_confusion": confusion,
        "forced_adherence": {s: confusion[s][s] / prompts for s in names},
        "mode_paths": {s: {"ids": p[0].tolist(), "gates": p[1].tolist()} for s, p in paths.items()},
    }


if __name__ == "__main__":  # python path_forcing.py SAVE PROMPTS SEED: the evaluation as JSON on stdout
    print(json.dumps(evaluate(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))))
