"""A step's arrays as one flat ``int64`` payload: what rank 0 sends the tensor-parallel
workers each step (:mod:`nybble.distributed.channel`).

Only what the forward reads crosses: ``input_ids``, ``positions``, ``slot_mapping`` (``T``
each), ``block_tables`` (``B x MB``), ``seq_lens`` (``B``), ``query_start_loc`` (``B + 1``)
and the copy-on-write pairs (``2 x C``), all as int64, i.e. ``8 * (3T + B*MB + 2B + 1 + 2C)``
bytes; the sizes and ``max_query_len`` / ``max_seq_len`` travel as the command's ints.
Sampling state never leaves rank 0.
"""
from __future__ import annotations

import numpy as np
import torch

from nybble.runtime.scheduler.batch import ScheduledBatch

_FIELDS = (("input_ids", np.int32), ("positions", np.int64), ("slot_mapping", np.int64),
           ("block_tables", np.int32), ("seq_lens", np.int32), ("query_start_loc", np.int32),
           ("copy_src", np.int32), ("copy_dst", np.int32))


def pack_step(batch: ScheduledBatch) -> tuple[list[int], torch.Tensor]:
    """``(ints, payload)``: ``ints = [T, B, MB, C, max_query_len, max_seq_len]`` and the
    flat ``int64`` payload of the fields, in :data:`_FIELDS` order."""
    bt = batch.block_tables
    ints = [batch.num_tokens, batch.num_seqs, bt.shape[1] if bt.ndim == 2 else 0,
            len(batch.copy_src), batch.max_query_len, batch.max_seq_len]
    flat = np.concatenate([np.asarray(getattr(batch, name)).reshape(-1).astype(np.int64)
                           for name, _ in _FIELDS])
    return ints, torch.from_numpy(flat)


def unpack_step(ints: tuple[int, ...], payload: torch.Tensor) -> ScheduledBatch:
    """The :class:`ScheduledBatch` of :func:`pack_step` (no sampled rows: workers do not
    sample).

    Raises:
        ValueError: the payload's length does not match the sizes in ``ints``.
    """
    t, b, mb, c, max_q, max_s = ints
    sizes = {"input_ids": t, "positions": t, "slot_mapping": t, "block_tables": b * mb,
             "seq_lens": b, "query_start_loc": b + 1, "copy_src": c, "copy_dst": c}
    flat = payload.cpu().numpy()
    if flat.shape[0] != sum(sizes.values()):
        raise ValueError(f"a step payload must hold {sum(sizes.values())} int64 values for "
                         f"T={t}, B={b}, MB={mb}, C={c}, got {flat.shape[0]}")
    arrays: dict[str, np.ndarray] = {}
    at = 0
    for name, dtype in _FIELDS:
        n = sizes[name]
        arrays[name] = np.ascontiguousarray(flat[at:at + n].astype(dtype))
        at += n
    arrays["block_tables"] = arrays["block_tables"].reshape(b, mb)
    empty = np.zeros(0, np.int64)
    return ScheduledBatch(num_seqs=b, num_tokens=t, max_query_len=max_q, max_seq_len=max_s,
                          seq_ids=np.zeros(b, np.int64), sample_rows=np.zeros(0, np.int32),
                          sample_seq_ids=empty, **arrays)
