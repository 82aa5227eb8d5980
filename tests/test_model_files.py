"""The one JSON reader of model folders (``nybble.model_files.read_json``): a missing file or
a JSON value other than an object reads as ``None``; a broken file raises, or reads as
``None`` when ``lenient`` (how each caller has always treated it)."""
from __future__ import annotations

import pytest

from nybble.model_files import file_bytes, read_json


def test_an_object_reads_as_itself(tmp_path) -> None:
    path = tmp_path / "config.json"
    path.write_text('{"vocab_size": 32, "nested": {"a": [1, 2]}}', encoding="utf-8")
    assert read_json(str(path)) == {"vocab_size": 32, "nested": {"a": [1, 2]}}
    assert read_json(str(path), lenient=True) == {"vocab_size": 32, "nested": {"a": [1, 2]}}


@pytest.mark.parametrize("lenient", [False, True])
def test_missing_files_folders_and_non_objects_read_as_none(tmp_path, lenient) -> None:
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "null.json").write_text("null")
    (tmp_path / "folder.json").mkdir()
    for name in ("absent.json", "list.json", "null.json", "folder.json"):
        assert read_json(str(tmp_path / name), lenient=lenient) is None, name


def test_a_broken_file_raises_unless_lenient(tmp_path) -> None:
    bad, latin = tmp_path / "bad.json", tmp_path / "latin.json"
    bad.write_text('{"vocab_size": ')
    latin.write_bytes(b'{"name": "\xe9"}')
    for path in (bad, latin):
        with pytest.raises(ValueError):
            read_json(str(path))
        assert read_json(str(path), lenient=True) is None


def test_file_bytes(tmp_path) -> None:
    (tmp_path / "tokenizer.model").write_bytes(b"\x00\x01")
    assert file_bytes(str(tmp_path / "tokenizer.model")) == b"\x00\x01"
    assert file_bytes(str(tmp_path / "absent")) is None
