"""INT4 g128 linear layers take at most 0.30x the bytes of their fp16 version (stories3m,
whose widths are multiples of 128), as the engine loads them."""
from __future__ import annotations

import torch

from nybble.config import ModelConfig
from nybble.kernels.reference.attention import TorchAttentionBackend
from nybble.models.loader import load_model
from nybble.quantize.driver import QuantizeOptions, quantize_model
from tests.conftest import shared_path

STORIES3M = shared_path("models", "stories3m")


def test_int4_g128_linear_bytes_ratio(tmp_path) -> None:
    out = str(tmp_path / "rtn-w4g128")
    quantize_model(STORIES3M, out, QuantizeOptions(method="rtn", bits=4, group_size=128),
                   progress=False)
    cpu = torch.device("cpu")
    fp = load_model(ModelConfig(model=STORIES3M, dtype="float16", device="cpu"),
                    TorchAttentionBackend(), cpu)
    q = load_model(ModelConfig(model=out, dtype="float16", device="cpu"),
                   TorchAttentionBackend(), cpu)
    # 4 layers x fused (K, N): qkv 256->512, o 256->256, gate_up 256->1536, down 768->256
    shapes = [(256, 512), (256, 256), (256, 1536), (768, 256)]
    assert fp.linear_weight_bytes == 4 * sum(2 * k * n for k, n in shapes)
    # GPTQ layout (quant-formats.md §3.1): qweight K*N/2, qzeros G*N/2, fp16 scales G*N*2,
    # int32 g_idx K*4 bytes, with G = K / 128.
    expected = 4 * sum(k * n // 2 + (k // 128) * n // 2 + (k // 128) * n * 2 + 4 * k
                       for k, n in shapes)
    assert q.linear_weight_bytes == expected
    ratio = q.linear_weight_bytes / fp.linear_weight_bytes
    assert ratio <= 0.30, ratio
    assert q.weight_bytes < fp.weight_bytes
