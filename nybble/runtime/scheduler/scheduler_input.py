"""The argument checks of ``Scheduler``, shared by the Cython scheduler and its plain-Python
reference.

Torch-free. The engine validates requests before they get here; these checks keep the
scheduler's own invariants (a request that cannot fit the whole pool would deadlock it).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from nybble.errors import KVCacheExhaustedError


def check_sizes(**sizes: int) -> None:
    """Every constructor size (blocks, tokens, sequences) must be >= 1.

    Raises:
        ValueError: naming the first size below 1.
    """
    for name, value in sizes.items():
        if value < 1:
            raise ValueError(f"`{name}` must be >= 1, got {value}")


def check_add(sched: Any, seq_id: int, token_ids: Any, max_tokens: int, stop_token_ids: Any,
              num_samples: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Validate one ``add`` against ``sched`` (its ``max_model_len``, ``max_num_seqs``,
    ``block_size``, ``num_blocks`` and ``seq_id in sched`` for ids in use).

    Returns:
        (prompt int32[P], stop ids int32[k], total tokens min(P + max_tokens, max_model_len)).

    Raises:
        ValueError: empty or non-1-D prompt, prompt > max_model_len, max_tokens < 1,
            num_samples outside [1, max_num_seqs], seq_id < 0 or an id already in use.
        KVCacheExhaustedError: the total tokens need more blocks than the whole pool.
    """
    prompt = np.ascontiguousarray(token_ids, dtype=np.int32)
    stops = np.ascontiguousarray(stop_token_ids, dtype=np.int32).reshape(-1)
    P, L = (prompt.shape[0] if prompt.ndim == 1 else 0), sched.max_model_len
    if P < 1:
        raise ValueError(f"`token_ids` must be a non-empty 1-D sequence, got shape "
                         f"{prompt.shape}")
    if P > L:
        raise ValueError(f"`token_ids` must have <= max_model_len={L} tokens, got {P}")
    if max_tokens < 1:
        raise ValueError(f"`max_tokens` must be >= 1, got {max_tokens}")
    if not 1 <= num_samples <= sched.max_num_seqs:
        raise ValueError(f"`num_samples` must be in [1, {sched.max_num_seqs}] "
                         f"(max_num_seqs), got {num_samples}")
    if seq_id < 0:
        raise ValueError(f"`seq_id` must be >= 0, got {seq_id}")
    for i in range(num_samples):
        if seq_id + i in sched:
            raise ValueError(f"`seq_id` must not be in use, got {seq_id + i}")
    total = min(P + max_tokens, L)
    need = -(-total // sched.block_size)
    if need > sched.num_blocks:
        raise KVCacheExhaustedError(
            f"request {seq_id} needs {need} KV blocks (min(prompt {P} + max_tokens "
            f"{max_tokens}, max_model_len {L}) = {total} tokens at {sched.block_size} per "
            f"block), but the pool holds only {sched.num_blocks} blocks", param="max_tokens")
    return prompt, stops, total
