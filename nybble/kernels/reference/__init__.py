"""Pure-torch references: paged attention, dequantization (CPU path, float64 oracles)."""
