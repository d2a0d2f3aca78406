"""One entry point, ``megatron-lol <verb>``.

Each verb lives in its own module exposing ``add_arguments(parser)`` and
``run(args) -> int``. Modules are imported lazily so that ``megatron-lol --help``
and light verbs (``params``, ``preprocess``) do not pay for importing
megatron-core (about 6 s per process).

Console hygiene lives here because it is the same for every verb:

* megatron-core warns at import time, once per module, that Apex / Transformer
  Engine are missing (about a dozen lines on a CPU machine) and, through its own
  ``TransformerConfig`` default, that ``cuda_graph_scope="full"`` is deprecated.
  None of these is actionable, so they become one ``note:`` line on rank 0;
  ``--verbose`` (or ``MEGATRON_LOL_VERBOSE=1``) shows them as they are.
* two more come from megatron-core's distributed optimizer at every run and are
  dropped: its ``zero_grad`` reads ``.grad`` of the FP32 shard views it makes
  (a non-leaf tensor; harmless), and it calls ``torch.distributed``'s
  ``reduce_scatter_tensor`` / ``all_gather_into_tensor``, which torch marks
  deprecated (the warning is raised in torch's ``c10d_logger.py``; this package
  calls neither). ``--verbose`` shows them too. So are megatron-core's
  ``load_state_dict is deprecated`` (its dist-checkpointing calls torch's old
  loader on every load) and, without CUDA, its advice to set
  ``CUDA_DEVICE_MAX_CONNECTIONS`` (about CUDA streams). Every other warning is
  shown unchanged.
* an unknown verb or option gets a "did you mean" from the known ones, a
  Megatron-LM flag without an equivalent here what to use instead; abbreviated
  options are refused. A flag error is one line (no usage: ``--help`` prints
  that), printed by rank 0 only under torchrun; the status is 2.
* a configuration error is printed by rank 0 only (every rank has the same
  configuration and exits with status 2), naming the flag beside the key.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import os
import re
import sys
import warnings
from typing import Callable

from megatron_lol import __version__
from megatron_lol.config.migration import ConfigDeprecationWarning
from megatron_lol.errors import CliError, ConfigError
from megatron_lol.log import VERBOSE_ENV, add_general_arguments

# verb -> (module, one-line help)
VERBS: dict[str, tuple[str, str]] = {
    "train": ("megatron_lol.training.cli", "pretrain a model from a YAML config"),
    "params": ("megatron_lol.perf.params_cli", "count total / non-embedding / active parameters"),
    "memory": ("megatron_lol.perf.memory_cli", "estimate per-rank memory of a parallel layout before a run"),
    "plan-layout": ("megatron_lol.perf.plan_cli", "propose parallel layouts and batch sizes for an allocation"),
    "preprocess": ("megatron_lol.data.preprocess", "tokenize corpora into Megatron indexed datasets"),
    "merge-datasets": ("megatron_lol.data.merge", "merge shard outputs of preprocess into one dataset"),
    "prepare-quickstart": (
        "megatron_lol.data.quickstart",
        "fetch the bundled corpus, train its tokenizer, preprocess it",
    ),
    "profile": ("megatron_lol.training.profile", "measure throughput, TFLOP/s and MFU of a config"),
    "convert-hf": ("megatron_lol.convert.to_hf_cli", "convert a checkpoint to a HuggingFace model directory"),
    "import-hf": ("megatron_lol.convert.from_hf", "import a Llama-architecture HF checkpoint"),
    "analyze": ("megatron_lol.analysis.cli", "routing analyses: heatmaps, paths, mode paths"),
    "generate": ("megatron_lol.inference.generate", "generate text from a checkpoint (exact KV-cached decoding)"),
    "evaluate": ("megatron_lol.inference.evaluate", "loss, perplexity, bits per byte of a checkpoint on held-out text"),
}


# (message pattern, whether it is about a missing optional accelerator); only warnings raised
# from megatron-core's own files are matched
KNOWN_WARNINGS = (
    (re.compile(r"(Transformer Engine and Apex are|Apex is|Transformer Engine is) not installed"), True),
    (re.compile(r"full scope is deprecated\. Use empty cuda_graph_scope"), False),
    (re.compile(r"\.grad attribute of a Tensor that is not a leaf Tensor is being accessed"), False),
    # megatron-core's dist-checkpointing calls torch's deprecated load_state_dict (every load)
    (re.compile(r"`load_state_dict` is deprecated and will be removed"), False),
)
# megatron-core's advice to set CUDA_DEVICE_MAX_CONNECTIONS=1 (once per rank) is about CUDA streams:
# dropped without CUDA, shown with it
CUDA_ONLY_WARNINGS = re.compile(r"environment variable CUDA_DEVICE_MAX_CONNECTIONS to 1")
# torch's deprecations of the collectives megatron-core calls, raised from torch's own file
KNOWN_TORCH_WARNINGS = re.compile(r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated")
ACCELERATOR_NOTE = (
    "note: Apex / Transformer Engine are not installed; megatron-core uses its torch "
    "implementations instead (--verbose shows its warnings)"
)


def quiet_known_warnings(stream=None) -> Callable[[], None]:
    """Collapse megatron-core's known start-up warnings (see the module docstring) into one
    ``note:`` line on ``stream`` (default stderr), printed by global rank 0 (``RANK``) only.

    Works at ``warnings.showwarning``, after the warning filters: ``-W error`` or
    ``PYTHONWARNINGS=ignore`` keep their meaning. Returns a function that restores the
    previous behaviour.
    """
    original = warnings.showwarning
    noted = [False]

    def show(message, category, filename, lineno, file=None, line=None):
        text = str(message)
        if "megatron" in str(filename):
            if CUDA_ONLY_WARNINGS.search(text) and not _cuda_available():
                return
            for pattern, accelerator in KNOWN_WARNINGS:
                if pattern.search(text):
                    if accelerator and not noted[0] and os.environ.get("RANK", "0") == "0":
                        noted[0] = True
                        print(ACCELERATOR_NOTE, file=stream or sys.stderr, flush=True)
                    return
        if str(filename).endswith("c10d_logger.py") and KNOWN_TORCH_WARNINGS.search(text):
            return
        if issubclass(category, ConfigDeprecationWarning):  # the user's config, not our code: one line, rank 0
            if os.environ.get("RANK", "0") == "0":
                print(f"warning: {text}", file=stream or sys.stderr, flush=True)
            return
        original(message, category, filename, lineno, file, line)

    warnings.showwarning = show

    def restore() -> None:
        warnings.showwarning = original

    return restore


def _cuda_available() -> bool:
    torch = sys.modules.get("torch")  # the warning comes from megatron-core, so torch is imported
    return bool(torch is not None and torch.cuda.is_available())


class Parser(argparse.ArgumentParser):
    """``argparse`` that answers an unknown option with what to use instead, and takes no abbreviations.

    A Megatron-LM flag without a flag here gets its own answer
    (:mod:`megatron_lol.config.megatron_lm`); any other unknown option the closest
    known one. Abbreviated options are refused, as Megatron-LM refuses them
    (``--train-iter 5`` is not ``--train-iters 5``).
    """

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        from megatron_lol.config.megatron_lm import hint

        match = re.match(r"unrecognized arguments: (.*)", message)
        if match:
            known = sorted(_option_strings(self))
            answers, guesses = [], []
            for arg in match.group(1).split():
                if not arg.startswith("-"):
                    continue
                flag = arg.split("=", 1)[0]
                if hint(flag):
                    answers.append(f"{flag}: {hint(flag)}")
                    continue
                close = closest_option(flag, known)
                if close:
                    guesses.append(f"{arg} -> {close}")
            if guesses:
                message += f" (did you mean: {', '.join(guesses)}?)"
            if answers:
                message += f" (Megatron-LM's {'; '.join(answers)})"
        # one line, not argparse's usage first (`--help` prints that); under torchrun every rank parses
        # the same arguments, so rank 0 says it and every rank exits 2
        if os.environ.get("RANK", "0") == "0":
            self._print_message(f"{self.prog}: error: {message} (--help lists the options)\n", sys.stderr)
        self.exit(2)


def closest_option(flag: str, known: list):
    """The known option ``flag`` is likely a typo of, or None. A known option that is a leading part
    of ``flag`` is not a typo of it (``--weight-decay-incr-style`` is not ``--weight-decay``)."""
    for close in difflib.get_close_matches(flag, known, n=3, cutoff=0.6):
        if not flag.startswith(close + "-"):
            return close
    return None


def _option_strings(parser: argparse.ArgumentParser) -> set:
    out = set()
    for action in parser._actions:
        out.update(s for s in action.option_strings if s.startswith("--"))
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out |= _option_strings(sub)
    return out


def version_string() -> str:
    """``megatron-lol X (megatron-core Y, torch Z)`` without importing either."""
    from importlib import metadata

    parts = []
    for dist in ("megatron-core", "torch"):
        try:
            parts.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            parts.append(f"{dist} not installed")
    return f"megatron-lol {__version__} ({', '.join(parts)})"


def main(argv: list[str] | None = None, *, faults=None) -> int:
    """``faults``: a :class:`~megatron_lol.training.hooks.FaultHooks` for ``train`` only, built by the
    tests' entry script (``tests/fault_rank_runner.py``); the console script passes none."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = Parser(
        prog="megatron-lol",
        description="Megatron-style pretraining of Library-of-Layers language models on megatron-core.",
        epilog="`megatron-lol VERB --help` lists a verb's own options; every verb takes --verbose.",
    )
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    for verb, (_, help_text) in VERBS.items():
        sub.add_parser(verb, help=help_text, add_help=False)
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    if argv[0] == "--version":
        print(version_string())
        return 0
    verb = argv[0]
    if faults is not None and verb != "train":
        raise ValueError(f"fault hooks are for the train verb, not {verb!r}")
    if verb not in VERBS:
        close = difflib.get_close_matches(verb, list(VERBS), n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        parser.error(f"unknown verb {verb!r} (choose from {', '.join(VERBS)}){hint}")
    module = importlib.import_module(VERBS[verb][0])
    verb_parser = Parser(prog=f"megatron-lol {verb}", description=VERBS[verb][1])
    module.add_arguments(verb_parser)
    add_general_arguments(verb_parser)
    args = verb_parser.parse_args(argv[1:])
    verbose = getattr(args, "verbose", False) or os.environ.get(VERBOSE_ENV, "") not in ("", "0")
    restore = None if verbose else quiet_known_warnings()
    try:
        return int((module.run(args) if faults is None else module.run(args, faults=faults)) or 0)
    except CliError as err:
        message = str(err)
        if isinstance(err, ConfigError):
            # a configuration is the same on every rank: rank 0 says what is wrong, every rank exits 2
            from megatron_lol.config.loader import name_flag

            message = name_flag(message, _option_strings(verb_parser))
            if os.environ.get("RANK", "0") != "0":
                return 2
        print(f"megatron-lol {verb}: error: {message}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # the reader went away (``megatron-lol params ... | head``): stop quietly, like coreutils
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return 141
    finally:
        if restore is not None:
            restore()


if __name__ == "__main__":
    sys.exit(main())
