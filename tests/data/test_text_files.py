"""TextFilesCorpus reading: files of any suffix when named, .txt/.jsonl when a directory is
scanned, and a warning for files that are valid UTF-8 but not text."""

from __future__ import annotations

import logging

import pytest

from dsdebug.data.corpus import TextFilesCorpus

LICENSE = "Apache License\nVersion 2.0, January 2004\n\nTERMS AND CONDITIONS FOR USE, REPRODUCTION.\n"


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_named_files_of_any_suffix_are_read_as_text(tmp_path, monkeypatch):
    (tmp_path / "LICENSE").write_text(LICENSE)
    (tmp_path / "Apache-2.0").write_text(LICENSE.upper())
    (tmp_path / "notes.md").write_text("# Notes\n\nsome text")
    (tmp_path / "rows.jsonl").write_text('{"text": "a jsonl document"}\n')
    monkeypatch.chdir(tmp_path)
    corpus = TextFilesCorpus(["LICENSE", "Apache-2.0", str(tmp_path / "*.md"), "rows.jsonl"])
    assert sorted(f.name for f in corpus.files) == ["Apache-2.0", "LICENSE", "notes.md", "rows.jsonl"]
    docs = list(corpus.documents())
    assert docs == [LICENSE.upper().strip(), LICENSE.strip(), "# Notes\n\nsome text", "a jsonl document"]


def test_directory_scan_takes_txt_and_jsonl_only(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.txt").write_text("text a")
    (tmp_path / "b.jsonl").write_text('{"text": "text b"}\n')
    for name in ("LICENSE", "c.csv", "d.md"):
        (tmp_path / name).write_text("not picked up by a directory scan")
    (tmp_path / "e.bin").write_bytes(b"\x00\x01" * 100)
    corpus = TextFilesCorpus(str(tmp_path))
    assert sorted(f.name for f in corpus.files) == ["a.txt", "b.jsonl"]
    assert sorted(corpus.documents()) == ["text a", "text b"]


@pytest.mark.parametrize("name,content,evidence", [
    ("nul.txt", "header " + "\x00" * 3000 + " trailer", ["3000 NUL bytes", "first at character 7"]),
    ("utf16.txt", "plain words in utf-16".encode("utf-16-le").decode("utf-8"), ["NUL bytes", "UTF-16"]),
    ("controls.txt", "".join(chr(c) for c in range(1, 9)) * 100 + "some text", ["control characters", "'\\x01'"]),
], ids=["nul", "utf16", "controls"])
def test_binary_looking_file_warns_once_naming_it(name, content, evidence, tmp_path, caplog):
    path = tmp_path / name
    path.write_text(content, encoding="utf-8")
    corpus = TextFilesCorpus(str(path))
    with caplog.at_level(logging.WARNING, logger="dsdebug.data.text_files"):
        assert len(list(corpus.documents())) == 1  # still used: a warning, not an error
        list(corpus.documents())  # a second pass (the BPE trains, then encodes) does not repeat it
    warnings = _warnings(caplog)
    assert len(warnings) == 1, warnings
    assert str(path) in warnings[0] and "looks binary" in warnings[0]
    for needle in evidence:
        assert needle in warnings[0], warnings[0]
    assert ("UTF-16" in warnings[0]) == (name == "utf16.txt")


def test_unusual_but_genuine_text_does_not_warn(tmp_path, caplog):
    samples = {
        "cjk.txt": "日本語のテキストです。中文文本，한국어 텍스트。" * 200,
        "emoji.txt": "🙂🚀🎉 mixed with words, ünïcödé and RTL עברית العربية\n" * 200,
        "tabs.txt": "col1\tcol2\tcol3\r\n" * 500 + "\f page break \v",
    }
    for name, text in samples.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    with caplog.at_level(logging.WARNING, logger="dsdebug.data.text_files"):
        docs = list(TextFilesCorpus(str(tmp_path / "*.txt")).documents())
    assert len(docs) == 3 and _warnings(caplog) == []
