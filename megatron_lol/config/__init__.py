"""megatron_lol.config"""
