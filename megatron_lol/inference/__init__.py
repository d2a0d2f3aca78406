"""Inference on training checkpoints: ``megatron-lol generate`` and ``megatron-lol evaluate``.

Both load a checkpoint of any parallel layout into the plain-PyTorch LoL model of
``megatron_lol/convert/hf_modeling`` (:mod:`.loading`), which decodes with the exact
LoL cache shared with HuggingFace exports.
"""
