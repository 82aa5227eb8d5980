"""nybble.runtime."""
