"""FP8 weight GEMMs for decode-sized steps: `mosaic_gpu.py` (W8A8 on Hopper's fp8 wgmma, weights [N, K]: a
single-device engine's) and `gpu.py` (weight-only, Triton, weights [K, N]: a tensor-parallel engine's)."""
