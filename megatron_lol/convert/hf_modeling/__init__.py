"""Templates copied verbatim into exported HuggingFace directories (remote code).

``configuration_lol.py`` and ``modeling_lol.py`` import only ``torch`` and
``transformers``; they must stay self-contained.
"""
