#!/usr/bin/env python
"""Convert a megatron-lol checkpoint to a HuggingFace model directory (same flags as
``megatron-lol convert-hf``); see docs/convert.md.

    python tools/convert_to_hf.py --load runs/tiny-cpu --save hf/tiny-cpu [--iteration N] [--dtype bf16|fp32]
"""

import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

from megatron_lol.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["convert-hf", *sys.argv[1:]]))
