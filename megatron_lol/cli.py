"""One entry point, ``megatron-lol <verb>``.

Each verb lives in its own module exposing ``add_arguments(parser)`` and
``run(args) -> int``. Modules are imported lazily so that ``megatron-lol --help``
and light verbs (``params``, ``preprocess``) do not pay for importing
megatron-core (about 6 s per process).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from megatron_lol.errors import CliError

# verb -> (module, one-line help)
VERBS: dict[str, tuple[str, str]] = {
    "train": ("megatron_lol.training.cli", "pretrain a model from a YAML config"),
    "params": ("megatron_lol.model.params_cli", "count total / non-embedding / active parameters"),
    "preprocess": ("megatron_lol.data.preprocess", "tokenize corpora into Megatron indexed datasets"),
    "merge-datasets": ("megatron_lol.data.merge", "merge shard outputs of preprocess into one dataset"),
    "prepare-quickstart": ("megatron_lol.data.quickstart", "fetch the bundled corpus, train its tokenizer, preprocess it"),
    "profile": ("megatron_lol.perf.profile", "measure throughput, TFLOP/s and MFU of a config"),
    "convert-hf": ("megatron_lol.convert.to_hf", "convert a checkpoint to a HuggingFace model directory"),
    "import-hf": ("megatron_lol.convert.from_hf", "import a Llama-architecture HF checkpoint"),
    "analyze": ("megatron_lol.analysis.cli", "routing analyses: heatmaps, paths, mode paths"),
    "generate": ("megatron_lol.inference.generate", "generate text from a checkpoint (exact KV-cached decoding)"),
    "evaluate": ("megatron_lol.inference.evaluate", "loss, perplexity, bits per byte of a checkpoint on held-out text"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="megatron-lol", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    for verb, (_, help_text) in VERBS.items():
        sub.add_parser(verb, help=help_text, add_help=False)
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    verb = argv[0]
    if verb not in VERBS:
        parser.error(f"unknown verb {verb!r} (choose from {', '.join(VERBS)})")
    module = importlib.import_module(VERBS[verb][0])
    verb_parser = argparse.ArgumentParser(prog=f"megatron-lol {verb}", description=VERBS[verb][1])
    module.add_arguments(verb_parser)
    args = verb_parser.parse_args(argv[1:])
    try:
        return int(module.run(args) or 0)
    except CliError as err:
        print(f"megatron-lol {verb}: error: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # the reader went away (``megatron-lol params ... | head``): stop quietly, like coreutils
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return 141


if __name__ == "__main__":
    sys.exit(main())
