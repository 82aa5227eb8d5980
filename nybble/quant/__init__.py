"""Quantized checkpoint formats, below ``nybble.models``: reading a checkpoint's
``quantization_config`` (:mod:`nybble.quant.config`) and the packed linear modules that hold
its tensors (:mod:`nybble.quant.linear`). The bit-packing layout lives in
:mod:`nybble.kernels.packing` (the kernels read it); the offline quantizers are
:mod:`nybble.quantize`.
"""
