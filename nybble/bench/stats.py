"""Per-backend throughput results and the KV-cache waste tracker shared by both backends."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class WasteTracker:
    """KV-cache memory waste sampled once per model step.

    Waste of one step = ``1 - live / allocated``: ``allocated`` is the number of KV slots
    (token positions, per layer) that the backend holds for sequences at that step, ``live`` the
    number of those slots holding a token of a still-running request. Steps where nothing is
    allocated are skipped. The mean is over steps (step-weighted), as the PagedAttention paper
    samples it.
    """

    samples: list[float] = field(default_factory=list)

    def add(self, live_slots: int, allocated_slots: int) -> None:
        """Record one step; ``0 <= live_slots <= allocated_slots`` (tokens)."""
        if allocated_slots <= 0:
            return
        if not 0 <= live_slots <= allocated_slots:
            raise AssertionError(f"live KV slots {live_slots} outside [0, {allocated_slots}]: "
                                 "a bug in the waste accounting")
        self.samples.append(1.0 - live_slots / allocated_slots)

    @property
    def mean(self) -> float | None:
        """Mean waste over sampled steps, in [0, 1] (``None`` before any sample)."""
        return sum(self.samples) / len(self.samples) if self.samples else None

    @property
    def peak(self) -> float | None:
        """Largest per-step waste, in [0, 1] (``None`` before any sample)."""
        return max(self.samples) if self.samples else None


@dataclass
class BackendResult:
    """One backend's pass over a request set.

    Attributes:
        backend: ``nybble`` or ``hf``.
        elapsed_s: wall time of the generation loop, seconds (model load and warm-up excluded).
        num_requests: requests completed.
        prompt_tokens: prompt tokens processed.
        output_tokens: generated tokens counted from the outputs, only up to each request's
            requested length (HF's extra tokens for shorter batch members are not counted).
        num_steps: model forward passes (engine steps / HF decoding steps).
        kv_waste_mean, kv_waste_peak: from :class:`WasteTracker`, fractions in [0, 1].
        extra: backend-specific facts (preemptions, KV blocks, waste source, ...).
    """

    backend: str
    elapsed_s: float
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    num_steps: int
    kv_waste_mean: float | None
    kv_waste_peak: float | None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def requests_per_s(self) -> float:
        """Completed requests per second."""
        return self.num_requests / self.elapsed_s

    @property
    def output_tokens_per_s(self) -> float:
        """Generated tokens per second."""
        return self.output_tokens / self.elapsed_s

    @property
    def total_tokens_per_s(self) -> float:
        """(Prompt + generated) tokens per second."""
        return (self.prompt_tokens + self.output_tokens) / self.elapsed_s

    def to_dict(self) -> dict[str, Any]:
        """All fields plus the three throughput figures."""
        return {**asdict(self), "requests_per_s": self.requests_per_s,
                "output_tokens_per_s": self.output_tokens_per_s,
                "total_tokens_per_s": self.total_tokens_per_s}
