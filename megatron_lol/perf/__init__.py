"""megatron_lol.perf"""
