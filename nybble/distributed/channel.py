"""Rank 0's commands to the other ranks: a small header through the rendezvous store, then
one flat payload broadcast.

Command ``i``'s header is ``int64[4 + n]`` ``[kind, payload numel, payload dtype code, n,
ints...]`` stored under key ``nybble/cmd/<i>``; the payload (``int64`` step arrays, or the
float hidden rows whose logits rank 0 needs) follows as one ``torch.distributed`` broadcast.
The header goes through the store, not a collective, so an idle engine's workers wait for
their next command without hitting the collectives' timeout, and wake every second to check
that rank 0's process is still alive.
"""
from __future__ import annotations

import datetime
import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from nybble.distributed.comm import TPGroup

_DTYPES = (torch.int64, torch.float32, torch.float16, torch.bfloat16)
_POLL = datetime.timedelta(seconds=1)


class Kind(enum.IntEnum):
    """What a command asks the workers to do."""

    SETUP = 1     # ints: the KV pool's block count; build the runner
    STEP = 2      # run the forward of the step whose arrays are the payload
    LOGITS = 3    # take part in the logits of the hidden rows in the payload
    STOP = 4      # leave the loop (engine shutdown)
    LORA = 5      # ints: [slot]; payload: an adapter folder's path (UTF-8 bytes as int64);
                  # load this rank's share of the adapter into that LoRA slot


@dataclass(frozen=True)
class Command:
    """One received command: its ``kind``, its ``ints`` and the flat ``payload`` (``None``
    when empty)."""

    kind: Kind
    ints: tuple[int, ...]
    payload: torch.Tensor | None


def _key(i: int) -> str:
    return f"nybble/cmd/{i}"


def send(group: TPGroup, kind: Kind, ints: Sequence[int] = (),
         payload: torch.Tensor | None = None) -> None:
    """Send a command from rank 0 (``payload``: any shape, flattened; dtype int64, float32,
    float16 or bfloat16).

    Raises:
        ValueError: a payload dtype outside those four.
    """
    numel, code = 0, 0
    if payload is not None:
        if payload.dtype not in _DTYPES:
            raise ValueError(f"payload dtype must be one of {_DTYPES}, got {payload.dtype}")
        numel, code = payload.numel(), _DTYPES.index(payload.dtype)
    i = group.counter[0]
    header = np.array([int(kind), numel, code, len(ints), *ints], dtype=np.int64)
    group.store.set(_key(i), header.tobytes())
    if i >= 2:      # NOTE: every worker has read command i - 2: it joined its collectives
        group.store.delete_key(_key(i - 2))
    group.counter[0] = i + 1
    if numel:
        group.broadcast(payload.reshape(-1).contiguous().to(group.device))


def receive(group: TPGroup, keep_waiting: Callable[[], bool]) -> Command | None:
    """Wait for rank 0's next command (on ranks 1..N-1); the payload arrives on the group's
    device. ``keep_waiting()`` is asked once a second while none comes; ``None`` when it
    says no (rank 0's process is gone)."""
    key = _key(group.counter[0])
    while True:
        try:
            group.store.wait([key], _POLL)
            break
        except RuntimeError:    # DistStoreError (a RuntimeError): nothing within a second
            if not keep_waiting():
                return None
    header = np.frombuffer(group.store.get(key), dtype=np.int64)
    group.counter[0] += 1
    kind, numel, code, n = (int(v) for v in header[:4])
    payload = None
    if numel:
        payload = group.broadcast(torch.empty(numel, dtype=_DTYPES[code], device=group.device))
    return Command(Kind(kind), tuple(int(v) for v in header[4:4 + n]), payload)
