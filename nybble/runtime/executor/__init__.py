"""Tensor-parallel executors (mp, ray), their worker ranks and the step payload."""
