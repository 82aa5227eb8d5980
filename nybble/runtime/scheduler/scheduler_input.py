"""The argument checks of ``Scheduler``, shared by the Cython scheduler and its plain-Python
reference, and the KV-fit rule (:func:`check_kv_fit`), which the request gate applies too.

Sliding windows (vLLM's sliding-window KV manager): when every attention layer has a window,
the scheduler frees the blocks that fell out of the largest one ``W``, so a running sequence
holds at most :func:`window_blocks` blocks at a time however long it grows; the fit rule and
:func:`pool_tokens` count that instead of its whole length.

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


def check_window(sliding_window: int | None) -> int:
    """The scheduler's ``sliding_window`` argument as an int (0: none).

    Raises:
        ValueError: not None and below 1.
    """
    if sliding_window is None:
        return 0
    if int(sliding_window) < 1:
        raise ValueError(f"`sliding_window` must be None or >= 1 (tokens), got {sliding_window}")
    return int(sliding_window)


def window_blocks(sliding_window: int, max_num_batched_tokens: int, block_size: int) -> int:
    """Most blocks one sequence holds at a time when blocks out of a window of
    ``sliding_window`` tokens are freed: a step's earliest query at position ``q0`` reads keys
    from ``q0 - W + 1`` and its at most ``B = max_num_batched_tokens`` tokens end at
    ``q0 + B - 1``, a span of ``W - 1 + B`` positions, which touches at most
    ``ceil((W - 1 + B) / block_size) + 1`` blocks."""
    return -(-(sliding_window - 1 + max_num_batched_tokens) // block_size) + 1


def pool_tokens(num_blocks: int, block_size: int, sliding_window: int | None = None,
                max_num_batched_tokens: int = 0) -> int | None:
    """The longest sequence (tokens) a pool of ``num_blocks`` blocks can run alone: all its
    blocks, or -- with a sliding window, one block being the null block -- any length
    (``None``) when :func:`window_blocks` fit the other ``num_blocks - 1``, else their
    tokens."""
    if not sliding_window:
        return num_blocks * block_size
    if window_blocks(sliding_window, max_num_batched_tokens, block_size) <= num_blocks - 1:
        return None
    return (num_blocks - 1) * block_size


def check_kv_fit(num_prompt: int, max_tokens: int, max_model_len: int, block_size: int,
                 num_blocks: int, num_sequences: int = 1, subject: str = "the request",
                 max_tokens_name: str = "max_tokens", sliding_window: int | None = None,
                 max_num_batched_tokens: int = 0) -> int:
    """The KV-fit rule: a sequence of ``min(prompt + max_tokens, max_model_len)`` tokens
    (``num_sequences`` of them at once: the beams of a beam search, which advance together)
    must fit the whole pool of ``num_blocks`` blocks of ``block_size`` tokens, so the
    scheduler can always run the oldest request alone. With a ``sliding_window`` (every layer
    windowed; blocks out of it are freed) a sequence needs at most :func:`window_blocks`
    blocks at a time (``max_num_batched_tokens`` tokens per step), and the pool loses one
    block, the null block.

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
    per_seq, usable, held = -(-total // block_size), num_blocks, ""
    if sliding_window:
        usable -= 1
        held = " (one more is the null block of sliding windows)"
        cap = window_blocks(sliding_window, max_num_batched_tokens, block_size)
        if cap < per_seq:
            per_seq, held = cap, (f" for a sliding window of {sliding_window} tokens: "
                                  f"ceil((window - 1 + max_num_batched_tokens "
                                  f"{max_num_batched_tokens}) / {block_size}) + 1 = {cap} "
                                  f"blocks at a time{held}")
    need = per_seq * num_sequences
    if need > usable:
        beams = f"{num_sequences} beams x " if num_sequences > 1 else ""
        raise KVCacheExhaustedError(
            f"{subject} needs {need} KV blocks ({beams}min(prompt {num_prompt} + "
            f"{max_tokens_name} {max_tokens}, max_model_len {max_model_len}) = {total} tokens "
            f"at {block_size} per block{held}), but the KV cache holds only {usable} blocks",
            param=max_tokens_name)
    return total


def check_add(sched: Any, seq_id: int, token_ids: Any, max_tokens: int, stop_token_ids: Any,
              num_samples: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Validate one ``add`` against ``sched`` (its ``max_model_len``, ``max_num_seqs``,
    ``block_size``, ``num_blocks``, ``sliding_window``, ``max_num_batched_tokens`` and
    ``seq_id in sched`` for ids in use).

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
                         subject=f"request {seq_id}", sliding_window=sched.sliding_window,
                         max_num_batched_tokens=sched.max_num_batched_tokens)
    return prompt, stops, total
