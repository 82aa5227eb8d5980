"""nybble.server."""
