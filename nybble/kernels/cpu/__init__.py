"""CPU kernels (Cython + C): decode attention, weight-only GEMM, fused decode step."""
