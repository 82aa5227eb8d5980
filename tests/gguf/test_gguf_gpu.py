"""On CUDA, GGUF weights run through the Triton dequant-GEMM (the float-minimum variant for
Q4_1/Q4_K/Q5_K): prefill logits equal the CPU reference path's within float32 GEMM tolerance."""
from __future__ import annotations

import os

import pytest
import torch

from nybble.config import ModelConfig
from nybble.kernels.reference.attention import TorchAttentionBackend
from nybble.models.loader import load_model
from nybble.models.scoring import prefill_logits
from tests.conftest import shared_path

BASE = shared_path("fixtures", "gguf")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("name", ["stories3m-Q4_1.gguf", "stories3m-Q4_K_M.gguf",
                                  "stories3m-Q5_K_M.gguf", "stories3m-Q4_0.gguf"])
def test_cuda_logits_match_cpu(name: str) -> None:
    path = os.path.join(BASE, name)
    ids = [1, 403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338,
           401, 396]   # > 16 tokens on CPU: the exact reference path
    logits = {}
    for dev in ("cpu", "cuda"):
        loaded = load_model(ModelConfig(model=path, dtype="float32", device=dev),
                            TorchAttentionBackend(), torch.device(dev))
        logits[dev] = prefill_logits(loaded, [ids])[0].float().cpu()
    torch.testing.assert_close(logits["cuda"], logits["cpu"], atol=2e-3, rtol=1e-4)
