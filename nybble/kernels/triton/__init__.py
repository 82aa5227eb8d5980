"""Triton kernels (CUDA, or TRITON_INTERPRET=1): paged attention, cache, dequant-GEMM."""
