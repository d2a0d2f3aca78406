"""megatron_lol.analysis"""
