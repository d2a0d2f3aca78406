"""megatron_lol.model"""
