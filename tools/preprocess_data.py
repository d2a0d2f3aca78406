#!/usr/bin/env python
"""Drop-in for Megatron-LM's tools/preprocess_data.py (same flags); see docs/data.md."""

import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

from megatron_lol.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["preprocess", *sys.argv[1:]]))
