"""Weight-only FP8 GEMM kernels (decode-sized steps): `gpu.py`."""
