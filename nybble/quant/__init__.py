"""Quantized checkpoint formats, below ``nybble.models``: reading a checkpoint's
``quantization_config`` (:mod:`nybble.quant.config`), the packed linear modules that hold its
tensors (:mod:`nybble.quant.linear` for GPTQ/AWQ, :mod:`nybble.quant.compressed` for
compressed-tensors), and the quality report that ``nybble quantize`` writes beside a
checkpoint (:mod:`nybble.quant.report`). The bit-packing layout and the CPU kernels live in
:mod:`nybble.kernels`; the offline quantizers are :mod:`nybble.quantize`.
"""
