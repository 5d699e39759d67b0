"""Causal GQA flash attention for long fresh prefills (kernels arrive with the kernel issue)."""
