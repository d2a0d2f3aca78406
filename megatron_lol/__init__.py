"""megatron-lol: Library-of-Layers language models on megatron-core."""

__version__ = "0.1.0"
