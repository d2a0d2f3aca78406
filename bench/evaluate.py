"""``evaluate``'s throughput against the training forward, on the bundled validation split.

    python bench/evaluate.py [--load RUN] [--config examples/configs/tiny-cpu.yaml] [--reference-docs 3]

Needs the quickstart data (``megatron-lol prepare-quickstart --output-dir data/quickstart``).
Without ``--load`` a checkpoint of the config is made first (one training step into a
temporary directory). The validation documents are those megatron-core's split
(``data.split``, ``98,2,0``) gives the validation set. In one process, one thread per
torch op pool as the trainer uses:

* **training forward** (the baseline): the trainer's validation forward
  (``Trainer._run_schedule(forward_only=True)``, megatron-core's schedule on
  ``LoLGPTModel``) over training-length micro-batches of the training data;
* **evaluate**: the packed scoring of ``megatron-lol evaluate``
  (:class:`megatron_lol.inference.packed_eval.PackedScorer`) of every validation
  document, timed from packing to the per-document sums;
* **one row per piece (plain-PyTorch model)**: the scoring of the HuggingFace
  export's model, one piece per row, micro-batch 4, on the first ``--reference-docs``
  documents (for the record: the path ``evaluate`` took before).

Tokens/s count scored tokens (evaluate) or input tokens (training forward). The three are
repeated ``--repeats`` times, interleaved, and the fastest of each is reported (a shared
machine can only slow a measurement down).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def validation_documents(prefix: str, split: str, eod: int) -> list:
    """Token lists of the validation documents (megatron-core's split of ``prefix``), trailing EOD dropped."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix, mmap=True)
    n = len(ds.document_indices) - 1
    beg, end = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))[1]
    docs = []
    for d in range(int(round(beg * n)), int(round(end * n))):
        tokens = [
            int(t) for i in range(int(ds.document_indices[d]), int(ds.document_indices[d + 1])) for t in ds[i].tolist()
        ]
        if tokens and tokens[-1] == eod:
            tokens = tokens[:-1]
        if tokens:
            docs.append(tokens)
    return docs


def make_checkpoint(config: str, out: str) -> str:
    save = os.path.join(out, "run")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_lol",
            "train",
            "--config",
            config,
            "--save",
            save,
            "--train-iters",
            "1",
            "--set",
            "training.eval_at_start=false",
            "--eval-iters",
            "0",
        ],
        check=True,
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
    )
    return save


def training_forward(cfg, batches: int):
    """A function timing the trainer's forward-only schedule over ``batches`` micro-batch groups:
    ``() -> (tokens, seconds)``."""
    import torch

    from megatron_lol.training.trainer import StepStats, Trainer

    cfg.training.eval_iters = 0
    trainer = Trainer(cfg).setup()
    data = trainer.data_iterator(trainer.train_ds, 0)
    tr = cfg.training

    def run() -> tuple:
        for chunk in trainer.model_chunks:
            chunk.eval()
        with torch.no_grad():
            t0 = time.perf_counter()
            for _ in range(batches):
                trainer._run_schedule(data, trainer.plan.depth, True, StepStats())
            seconds = time.perf_counter() - t0
        return batches * trainer.num_microbatches * tr.micro_batch_size * tr.seq_length, seconds

    run()  # warm-up
    return run


def best(runs: list) -> tuple:
    """The fastest of repeated ``(tokens, seconds)`` measurements (a shared machine only slows things)."""
    return min(runs, key=lambda r: r[1] / r[0])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--config", default=os.path.join(REPO, "examples", "configs", "tiny-cpu.yaml"))
    p.add_argument("--load", default=None, help="a checkpoint of the config (default: one made here)")
    p.add_argument("--batches", type=int, default=12, help="training-forward micro-batch groups to time")
    p.add_argument("--reference-docs", type=int, default=3, help="documents for the plain-PyTorch path")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats; the fastest of each is reported")
    args = p.parse_args()
    os.chdir(REPO)
    import torch

    torch.set_num_threads(1)
    from megatron_lol.config import load_config
    from megatron_lol.convert.checkpoint import iteration_dir, read_run_config
    from megatron_lol.inference.evaluate import pieces, score_rows
    from megatron_lol.inference.loading import load_model
    from megatron_lol.inference.packed_eval import PackedScorer, build_model
    from megatron_lol.platform import init_distributed, setup_platform

    setup_platform()
    init_distributed()
    with tempfile.TemporaryDirectory() as tmp:
        load = args.load or make_checkpoint(args.config, tmp)
        path, _ = iteration_dir(load)
        run_cfg, info, _ = read_run_config(path, load)
        eod = info["tokenizer"]["eod_id"]
        cfg = load_config(args.config)
        docs = validation_documents(cfg.data.paths[-1], cfg.data.split, eod)
        seq = run_cfg.training.seq_length
        rows = [r for i, d in enumerate(docs) for r in pieces(i, d, eod, seq)]
        scored = sum(len(r[2]) for r in rows)

        forward = training_forward(cfg, args.batches)
        chunks = build_model(run_cfg, run_cfg.model.vocab_size, eod, path)
        scorer = PackedScorer(chunks, run_cfg.training.micro_batch_size, seq, eod)
        loaded = load_model(load)
        few = [r for r in rows if r[0] < args.reference_docs]
        ref_tokens = sum(len(r[2]) for r in few)

        def evaluate() -> tuple:
            t0 = time.perf_counter()
            scorer.score(rows, len(docs))
            return scored, time.perf_counter() - t0

        def reference() -> tuple:
            t0 = time.perf_counter()
            for i in range(0, len(few), 4):
                score_rows(loaded.model, few[i : i + 4], pad=0)
            return ref_tokens, time.perf_counter() - t0

        runs = {"forward": [], "evaluate": [], "reference": []}
        for _ in range(args.repeats):  # interleaved, so a busy spell slows each path alike
            runs["forward"].append(forward())
            runs["evaluate"].append(evaluate())
            runs["reference"].append(reference())
        (train_tokens, train_s), (_, eval_s), (_, ref_s) = (best(runs[k]) for k in runs)

    base = train_tokens / train_s
    print(
        f"{args.config}: validation split {cfg.data.split} of {cfg.data.paths[-1]}: {len(docs)} documents, "
        f"{scored:,} tokens, {len(rows)} pieces of <= {seq} tokens; torch threads 1"
    )
    print(f"{'path':<46} {'tokens':>9} {'seconds':>8} {'tokens/s':>9} {'vs training forward':>20}")
    for name, tokens, seconds in (
        (f"training forward (baseline, micro-batches of {cfg.training.micro_batch_size})", train_tokens, train_s),
        ("evaluate (packed rows, training forward)", scored, eval_s),
        (f"one row per piece, plain-PyTorch model ({args.reference_docs} docs)", ref_tokens, ref_s),
    ):
        rate = tokens / seconds
        print(f"{name:<46} {tokens:>9,} {seconds:>8.1f} {rate:>9,.0f} {rate / base:>19.2f}x")


if __name__ == "__main__":
    main()
