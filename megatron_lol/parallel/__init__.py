"""megatron_lol.parallel"""
