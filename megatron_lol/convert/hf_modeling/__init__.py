"""Templates copied verbatim into exported HuggingFace directories (remote code).

``configuration_lol.py``, ``modeling_lol.py`` and the modules it imports (``layers_lol.py``,
``cache_lol.py``, ``decoding_lol.py``; ``convert.to_hf.TEMPLATE_FILES``) import only ``torch``,
``transformers`` and each other (relative imports); they must stay self-contained.
megatron-lol's own ``generate`` and ``evaluate`` import them from here.
"""
