"""megatron_lol.training"""
