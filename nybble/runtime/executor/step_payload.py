"""A step's arrays as one flat ``int64`` payload: what rank 0 sends the tensor-parallel
workers each step (:mod:`nybble.distributed.channel`).

Only what the forward reads crosses: ``input_ids``, ``positions``, ``slot_mapping`` (``T``
each), ``block_tables`` (``B x MB``), ``seq_lens`` (``B``), ``query_start_loc`` (``B + 1``)
the copy-on-write pairs (``2 x C``) and, when a row of the step uses a LoRA adapter, each
row's adapter slot (``L = T``, else ``L = 0``), all as int64, i.e.
``8 * (3T + B*MB + 2B + 1 + 2C + L)`` bytes; the sizes and ``max_query_len`` /
``max_seq_len`` travel as the command's ints.
Sampling state never leaves rank 0.
"""
from __future__ import annotations

import numpy as np
import torch

from nybble.runtime.scheduler.batch import ScheduledBatch

_FIELDS = (("input_ids", np.int32), ("positions", np.int64), ("slot_mapping", np.int64),
           ("block_tables", np.int32), ("seq_lens", np.int32), ("query_start_loc", np.int32),
           ("copy_src", np.int32), ("copy_dst", np.int32))


def pack_step(batch: ScheduledBatch, token_slots: torch.Tensor | None = None
              ) -> tuple[list[int], torch.Tensor]:
    """``(ints, payload)``: ``ints = [T, B, MB, C, max_query_len, max_seq_len, L]`` and the
    flat ``int64`` payload of the fields, in :data:`_FIELDS` order, then ``token_slots``
    (``[T]`` int64 LoRA slot of each row, ``-1``: base; None: no row uses an adapter,
    ``L = 0``)."""
    bt = batch.block_tables
    slots = [] if token_slots is None else [token_slots.cpu().numpy().astype(np.int64)]
    ints = [batch.num_tokens, batch.num_seqs, bt.shape[1] if bt.ndim == 2 else 0,
            len(batch.copy_src), batch.max_query_len, batch.max_seq_len,
            0 if token_slots is None else batch.num_tokens]
    flat = np.concatenate([np.asarray(getattr(batch, name)).reshape(-1).astype(np.int64)
                           for name, _ in _FIELDS] + slots)
    return ints, torch.from_numpy(flat)


def unpack_step(ints: tuple[int, ...], payload: torch.Tensor
                ) -> tuple[ScheduledBatch, torch.Tensor | None]:
    """The :class:`ScheduledBatch` of :func:`pack_step` (no sampled rows: workers do not
    sample) and its ``token_slots`` (``[T]`` int64, or None), on ``payload``'s device.

    Raises:
        ValueError: the payload's length does not match the sizes in ``ints``.
    """
    t, b, mb, c, max_q, max_s, num_slots = ints
    sizes = {"input_ids": t, "positions": t, "slot_mapping": t, "block_tables": b * mb,
             "seq_lens": b, "query_start_loc": b + 1, "copy_src": c, "copy_dst": c,
             "token_slots": num_slots}
    flat = payload.cpu().numpy()
    if flat.shape[0] != sum(sizes.values()):
        raise ValueError(f"a step payload must hold {sum(sizes.values())} int64 values for "
                         f"T={t}, B={b}, MB={mb}, C={c}, L={num_slots}, got {flat.shape[0]}")
    arrays: dict[str, np.ndarray] = {}
    at = 0
    for name, dtype in _FIELDS:
        n = sizes[name]
        arrays[name] = np.ascontiguousarray(flat[at:at + n].astype(dtype))
        at += n
    arrays["block_tables"] = arrays["block_tables"].reshape(b, mb)
    token_slots = None if num_slots == 0 else payload[at:at + num_slots]
    empty = np.zeros(0, np.int64)
    return ScheduledBatch(num_seqs=b, num_tokens=t, max_query_len=max_q, max_seq_len=max_s,
                          seq_ids=np.zeros(b, np.int64), sample_rows=np.zeros(0, np.int32),
                          sample_seq_ids=empty, **arrays), token_slots
