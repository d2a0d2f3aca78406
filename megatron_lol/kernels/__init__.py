"""Fused kernels that torch and the installed libraries do not provide (CPU, built on first use)."""
