"""megatron_lol.convert"""
