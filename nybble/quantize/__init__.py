"""Offline quantization tools (top floor, beside ``nybble.server`` and ``nybble.bench``):
RTN / GPTQ / AWQ quantizers, calibration, export to the published checkpoint layouts, the
transformers-based oracle model and perplexity evaluation; ``nybble quantize`` and
``nybble eval-ppl``. They write and read the formats of :mod:`nybble.quant`.
"""
