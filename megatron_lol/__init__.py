"""megatron-lol: Library-of-Layers language models on megatron-core."""

from megatron_lol import megatron_import as _megatron_import

__version__ = "0.1.0"

_megatron_import.install()  # before anything imports megatron-core (megatron_lol/megatron_import.py)
