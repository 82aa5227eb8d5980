"""The Cython scheduling core (sequences, KV blocks, prefix cache, batches) and its reference."""
