"""nybble.models."""
