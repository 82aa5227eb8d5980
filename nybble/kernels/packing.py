"""Bit packing of integer weights into int32 words (docs/quant-formats.md §1, §3.2, §4.2, §6.2).

Pure functions with explicit ``bits``. Field ``i`` of a word is bits ``[bits*i, bits*i+bits)``
(field 0 least significant); words are stored as signed int32 but handled as uint32 bit
patterns (shifts happen on an int64 view masked to 32 bits). Supported widths: 2, 4, 8 bits
(``pf = 32 // bits`` values per word). 3-bit packing is not implemented.

The one definition of the layouts: it sits on the kernels floor because the dequantization
references read it, and the formats (``nybble.quant``) and exporters (``nybble.quantize``)
above import it from here.

Layouts built from these:
* GPTQ ``qweight [K/pf, N]`` = :func:`pack_rows` of ``q [K, N]``; ``qzeros [G, N/pf]`` =
  :func:`pack_cols` (sequential order).
* AWQ GEMM ``qweight [K, N/8]`` / ``qzeros [G, N/8]`` = :func:`pack_cols` with
  ``order=AWQ_ORDER``.
* compressed-tensors ``weight_packed [N, K/8]`` = :func:`pack_cols` of ``u [N, K]``.
"""
from __future__ import annotations

import torch

AWQ_ORDER: tuple[int, ...] = (0, 2, 4, 6, 1, 3, 5, 7)
"""Field i of an AWQ GEMM word holds column ``8c + AWQ_ORDER[i]`` (§4.2)."""
AWQ_REVERSE_ORDER: tuple[int, ...] = (0, 4, 1, 5, 2, 6, 3, 7)
"""Column ``8c + j`` lives in field ``AWQ_REVERSE_ORDER[j]`` (§4.2)."""

_SUPPORTED_BITS = (2, 4, 8)


def pack_factor(bits: int) -> int:
    """Values per int32 word, ``32 // bits``.

    Raises:
        ValueError: ``bits`` not in (2, 4, 8).
    """
    if bits not in _SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {_SUPPORTED_BITS}, got {bits!r}")
    return 32 // bits


def _to_i32(words: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2^32) -> the same bit patterns as int32."""
    words = words & 0xFFFFFFFF
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _check_values(values: torch.Tensor, bits: int) -> torch.Tensor:
    v = values.to(torch.int64)
    if v.numel() and (int(v.min()) < 0 or int(v.max()) > (1 << bits) - 1):
        raise ValueError(f"values must be in [0, {(1 << bits) - 1}] for {bits}-bit packing, got "
                         f"range [{int(v.min())}, {int(v.max())}]")
    return v


def _order(order: tuple[int, ...] | list[int] | None, pf: int) -> list[int]:
    if order is None:
        return list(range(pf))
    if sorted(order) != list(range(pf)):
        raise ValueError(f"order must be a permutation of range({pf}), got {list(order)}")
    return list(order)


def pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack along axis 0: ``[R*pf, C]`` ints in ``[0, 2^bits)`` -> int32 ``[R, C]``.

    Word ``[r, c]`` holds rows ``r*pf + i`` in field ``i`` (GPTQ ``qweight``, §3.2).

    Raises:
        ValueError: unsupported bits, rows not a multiple of ``pf``, or values out of range.
    """
    pf = pack_factor(bits)
    if values.dim() != 2 or values.shape[0] % pf:
        raise ValueError(f"values must be 2-D with rows a multiple of {pf}, got shape "
                         f"{tuple(values.shape)}")
    v = _check_values(values, bits).reshape(values.shape[0] // pf, pf, values.shape[1])
    shifts = (torch.arange(pf, dtype=torch.int64) * bits).view(1, pf, 1)
    return _to_i32((v << shifts).sum(dim=1))


def _fields(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Every ``bits``-wide field of int32 ``words``, stacked on a new axis ``dim`` (field
    ``i`` = bits ``[bits*i, bits*i+bits)``), int32.

    NOTE: int32 arithmetic: ``>>`` sign-extends a negative word, but the mask keeps only the
    field's own bits, so this equals the uint32 reading at half the memory of int64.
    """
    pf = pack_factor(bits)
    shape = [1] * (words.dim() + 1)
    shape[dim] = pf
    shifts = (torch.arange(pf, dtype=torch.int32, device=words.device) * bits).view(shape)
    return (words.to(torch.int32).unsqueeze(dim) >> shifts) & ((1 << bits) - 1)


def unpack_rows(words: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_rows`: int32 ``[R, C]`` -> int32 ``[R*pf, C]``.

    ``q[k, c] = (words[k // pf, c] >> (bits * (k % pf))) & mask``.
    """
    return _fields(words, bits, 1).reshape(words.shape[0] * pack_factor(bits), words.shape[1])


def pack_cols(values: torch.Tensor, bits: int,
              order: tuple[int, ...] | list[int] | None = None) -> torch.Tensor:
    """Pack along axis 1: ``[R, C*pf]`` -> int32 ``[R, C]``.

    Field ``i`` of word ``[r, c]`` holds column ``c*pf + order[i]`` (``order=None``: sequential,
    GPTQ ``qzeros`` and compressed-tensors; ``AWQ_ORDER`` for AWQ GEMM).

    Raises:
        ValueError: unsupported bits, columns not a multiple of ``pf``, values out of range,
            or ``order`` not a permutation.
    """
    pf = pack_factor(bits)
    if values.dim() != 2 or values.shape[1] % pf:
        raise ValueError(f"values must be 2-D with columns a multiple of {pf}, got shape "
                         f"{tuple(values.shape)}")
    idx = torch.tensor(_order(order, pf), dtype=torch.int64)
    v = _check_values(values, bits).reshape(values.shape[0], values.shape[1] // pf, pf)
    v = v[:, :, idx]  # field i <- column order[i]
    shifts = (torch.arange(pf, dtype=torch.int64) * bits).view(1, 1, pf)
    return _to_i32((v << shifts).sum(dim=2))


def unpack_cols(words: torch.Tensor, bits: int,
                order: tuple[int, ...] | list[int] | None = None) -> torch.Tensor:
    """Inverse of :func:`pack_cols`: int32 ``[R, C]`` -> int32 ``[R, C*pf]``."""
    pf = pack_factor(bits)
    ordr = _order(order, pf)
    fields = _fields(words, bits, 2)  # [R, C, field]
    if ordr != list(range(pf)):
        inv = torch.tensor([ordr.index(j) for j in range(pf)], dtype=torch.int64,
                           device=words.device)
        fields = fields[:, :, inv]
    return fields.reshape(words.shape[0], words.shape[1] * pf)
