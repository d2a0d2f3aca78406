"""megatron_lol.data"""
