"""The same inputs give byte-identical checkpoints, whatever thread count the caller runs with:
torch splits its CPU sums by thread count (on stories3m, 1 and 2 threads give different GPTQ
integers), so ``quantize_model`` pins the count (``QuantizeOptions.threads``, default 1) for
the run and restores the caller's afterwards."""
from __future__ import annotations

import hashlib
import os

import torch

from nybble.quantize.driver import QuantizeOptions, quantize_model
from tests.conftest import SHARED

STORIES3M = os.path.join(SHARED, "models", "stories3m")


def _digest(folder: str) -> dict[str, str]:
    out = {}
    for f in ("model.safetensors", "config.json", "quantize_config.json"):
        with open(os.path.join(folder, f), "rb") as fh:
            out[f] = hashlib.sha256(fh.read()).hexdigest()
    return out


def test_gptq_twice_gives_identical_files(tmp_path) -> None:
    with open(os.path.join(SHARED, "data", "stories-calib.txt"), encoding="utf-8") as f:
        calib = f.read()
    opts = QuantizeOptions(method="gptq", bits=4, group_size=128, calib_text=calib,
                           num_samples=8, seq_len=128)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        quantize_model(STORIES3M, str(tmp_path / "a"), opts, progress=False)
        torch.set_num_threads(2)
        quantize_model(STORIES3M, str(tmp_path / "b"), opts, progress=False)
        assert torch.get_num_threads() == 2  # the caller's count is restored
    finally:
        torch.set_num_threads(before)
    a, b = _digest(str(tmp_path / "a")), _digest(str(tmp_path / "b"))
    assert a == b
    # the reports agree on everything but the wall time
    ra = (tmp_path / "a" / "quantization_report.json").read_text().splitlines()
    rb = (tmp_path / "b" / "quantization_report.json").read_text().splitlines()
    assert [x for x in ra if "wall_time_s" not in x] == [x for x in rb if "wall_time_s" not in x]
