"""GGUF files (llama.cpp's single-file model format) read with gguf-py (PyPI ``gguf``):
the file checks and tensor directory (:mod:`nybble.gguf.reader`) and the mapping of its
metadata onto a Hugging Face config and tokenizer settings (:mod:`nybble.gguf.metadata`,
:mod:`nybble.gguf.side_folder`). NumPy only, no torch: the API process reads the metadata too.
The block types' unpacking into nybble's integer weights is :mod:`nybble.quant.gguf_blocks`."""
