"""``nybble plan``: the memory planner (weights, KV cache, what fits on a GPU)."""
