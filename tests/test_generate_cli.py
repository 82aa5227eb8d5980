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


def test_a_model_folder_as_the_first_prompt_points_at_model(capsys) -> None:
    from nybble.config import DEFAULT_MODEL
    assert main(["generate", DEFAULT_MODEL, "Once upon a time"]) == 2
    err = capsys.readouterr().err
    assert f"the first PROMPT {DEFAULT_MODEL!r} is a model folder; pass it as --model" in err


def test_a_gguf_file_as_the_first_prompt_points_at_model(capsys, tmp_path) -> None:
    """A .gguf file passed where the prompt goes is refused, not read as text for the bundled
    model (it used to generate from the file's path)."""
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    assert main(["generate", str(gguf), "Once upon a time"]) == 2
    err = capsys.readouterr().err
    assert f"the first PROMPT {str(gguf)!r} is a GGUF model file; pass it as --model" in err


def test_generate_chat_applies_the_chat_template(capsys) -> None:
    assert main(["generate", "--chat", "Tom found a red ball.", "--max-tokens", "12"]) == 0
    printed = capsys.readouterr().out.strip()
    llm = LLM()
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template([{"role": "user", "content": "Tom found a red ball."}])
    ids = tok.encode(text, add_special_tokens=False)
    want = llm.generate([ids], SamplingParams(temperature=0, max_tokens=12),
                        use_tqdm=False)[0].outputs[0].text
    assert want and printed == want.strip()
