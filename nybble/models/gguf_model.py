"""A GGUF file as the model loader sees it: its linear factory, its weight loader and a
one-line description (the GGUF counterpart of :class:`nybble.quant.config.QuantConfig`)."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from nybble.config import ModelConfig
from nybble.distributed.comm import TPGroup
from nybble.errors import UnsupportedModelError
from nybble.gguf.reader import GGUFFile
from nybble.models.gguf_loader import GGUFFactory, load_gguf_weights
from nybble.models.llama import LlamaForCausalLM
from nybble.quant.linear import CpuPathLog


@dataclass
class GGUFModel:
    """An opened GGUF model file.

    Attributes:
        file: the parsed file. path_log: logs each CPU matmul choice once.
    """

    file: GGUFFile
    path_log: CpuPathLog = field(default_factory=CpuPathLog)

    @property
    def factory(self) -> GGUFFactory:
        """The ``LinearFactory`` of the file's projections."""
        return GGUFFactory(self.file, self.path_log)

    def load(self, model: LlamaForCausalLM, dtype: torch.dtype) -> None:
        """Fill ``model`` from the file (:func:`load_gguf_weights`)."""
        load_gguf_weights(model, self.file, dtype, self.path_log)

    def describe(self) -> str:
        """``gguf (Q4_1 x210, Q8_0 x1, F32 x61)``: the tensor types, most frequent first."""
        counts = Counter(t.type_name for t in self.file.tensors.values())
        return "gguf (" + ", ".join(f"{k} x{v}" for k, v in counts.most_common()) + ")"


def open_gguf(cfg: ModelConfig, tp: TPGroup | None) -> GGUFModel:
    """Open ``cfg.model`` (a ``.gguf`` file).

    Raises:
        UnsupportedModelError: a bad file (:class:`GGUFFile`), a ``quantization`` other than
            None/``gguf``, or tensor parallelism (GGUF models run on one rank).
    """
    if cfg.quantization not in (None, "gguf"):
        raise UnsupportedModelError(f"quantization must be unset or 'gguf' for a GGUF file, "
                                    f"got {cfg.quantization!r}")
    if tp is not None and tp.world_size > 1:
        raise UnsupportedModelError(f"a GGUF model runs with tensor_parallel_size 1, got "
                                    f"{tp.world_size}")
    return GGUFModel(GGUFFile(cfg.model))
