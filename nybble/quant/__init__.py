"""nybble.quant."""
