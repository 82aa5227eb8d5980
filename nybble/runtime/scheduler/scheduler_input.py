"""The argument checks of ``Scheduler``, shared by the Cython scheduler and its plain-Python
reference, and the KV-fit rule (:func:`check_kv_fit`), which the request gate applies too.

Torch-free (the API process runs the gate). The engine validates requests before they get
here; these checks keep the scheduler's own invariants (a request that cannot fit the whole
pool would deadlock it).
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


def check_kv_fit(num_prompt: int, max_tokens: int, max_model_len: int, block_size: int,
                 num_blocks: int, num_sequences: int = 1, subject: str = "the request",
                 max_tokens_name: str = "max_tokens") -> int:
    """The KV-fit rule: a sequence of ``min(prompt + max_tokens, max_model_len)`` tokens
    (``num_sequences`` of them at once: the beams of a beam search, which advance together)
    must fit the whole pool of ``num_blocks`` blocks of ``block_size`` tokens, so the
    scheduler can always run the oldest request alone.

    Args:
        subject: who needs the blocks, for the message (``"request 3"``).
        max_tokens_name: the API's name of ``max_tokens``, for the message and the error's
            ``param``.

    Returns:
        The tokens of one sequence, ``min(num_prompt + max_tokens, max_model_len)``.

    Raises:
        KVCacheExhaustedError: the blocks needed, and the sum behind them, named.
    """
    total = min(num_prompt + max_tokens, max_model_len)
    need = -(-total // block_size) * num_sequences
    if need > num_blocks:
        beams = f"{num_sequences} beams x " if num_sequences > 1 else ""
        raise KVCacheExhaustedError(
            f"{subject} needs {need} KV blocks ({beams}min(prompt {num_prompt} + "
            f"{max_tokens_name} {max_tokens}, max_model_len {max_model_len}) = {total} tokens "
            f"at {block_size} per block), but the KV cache holds only {num_blocks} blocks",
            param=max_tokens_name)
    return total


def check_add(sched: Any, seq_id: int, token_ids: Any, max_tokens: int, stop_token_ids: Any,
              num_samples: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Validate one ``add`` against ``sched`` (its ``max_model_len``, ``max_num_seqs``,
    ``block_size``, ``num_blocks`` and ``seq_id in sched`` for ids in use).

    Returns:
        (prompt int32[P], stop ids int32[k], total tokens min(P + max_tokens, max_model_len)).

    Raises:
        ValueError: empty or non-1-D prompt, prompt > max_model_len, max_tokens < 1,
            num_samples outside [1, max_num_seqs], seq_id < 0 or an id already in use.
        KVCacheExhaustedError: the total tokens need more blocks than the whole pool
            (:func:`check_kv_fit`).
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
    total = check_kv_fit(P, max_tokens, L, sched.block_size, sched.num_blocks,
                         subject=f"request {seq_id}")
    return prompt, stops, total
