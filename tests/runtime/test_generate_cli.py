"""``nybble generate`` prints the same greedy text as ``LLM.generate``; bad flags exit 2."""
from __future__ import annotations

from nybble import LLM, SamplingParams
from nybble.cli import main


def test_generate_prints_greedy_text(capsys) -> None:
    assert main(["generate", "Once upon a time", "--max-tokens", "12"]) == 0
    printed = capsys.readouterr().out.strip()
    want = LLM().generate("Once upon a time", SamplingParams(temperature=0, max_tokens=12),
                          use_tqdm=False)[0].outputs[0].text
    assert printed == "Once upon a time" + want


def test_generate_rejects_bad_max_tokens(capsys) -> None:
    assert main(["generate", "Hi", "--max-tokens", "-1"]) == 2
    assert "max_tokens must be >= 0, got -1" in capsys.readouterr().err


def test_missing_model_folder_is_one_clear_line(capsys) -> None:
    assert main(["generate", "Hi", "--model", "/nonexistent/model"]) == 2
    err = capsys.readouterr().err
    assert "'/nonexistent/model', which does not exist" in err
    assert "Traceback" not in err
