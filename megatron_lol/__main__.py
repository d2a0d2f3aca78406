import sys

from megatron_lol.cli import main

sys.exit(main())
