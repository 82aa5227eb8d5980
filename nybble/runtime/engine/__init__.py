"""The engine-core process: engine core, its busy loop, beam search (imports torch)."""
