"""The quantize-then-serve workflow: ``nybble quantize`` writes a folder that ``nybble serve``
serves, and the server's greedy text equals the offline engine's on the same folder."""
from __future__ import annotations

import openai
import pytest

from nybble import LLM, SamplingParams
from nybble.cli import main
from nybble.config import DEFAULT_MODEL

from .conftest import start_server, stop_server

pytestmark = [pytest.mark.server, pytest.mark.slow]


def test_serve_a_folder_written_by_nybble_quantize(tmp_path, capsys) -> None:
    out = tmp_path / "stories260k-gptq-w4g32"
    assert main(["quantize", DEFAULT_MODEL, "--method", "gptq", "--bits", "4", "--group-size",
                 "32", "--num-samples", "8", "--seq-len", "64", "--allow-unquantized",
                 "--out", str(out)]) == 0
    capsys.readouterr()
    prompt = "Once upon a time"
    offline = LLM(str(out)).generate(prompt, SamplingParams(temperature=0, max_tokens=24),
                                     use_tqdm=False)[0].outputs[0].text
    proc, url = start_server(tmp_path / "serve.log", str(out), "--served-model-name", "q")
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["q"]
        done = client.completions.create(model="q", prompt=prompt, max_tokens=24,
                                         temperature=0)
        assert done.choices[0].text == offline
        assert done.usage.completion_tokens == 24
        log = (tmp_path / "serve.log").read_text()
        assert "gptq" in log  # start-up logs the quantization it detected
    finally:
        stop_server(proc)
