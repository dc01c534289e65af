import pytest

from sleuth.errors import DataError
from sleuth.system.datafiles import jsonl_objects, read_text_file


def test_read_text_file_names_what_and_path(tmp_path):
    good = tmp_path / "a.jsonl"
    good.write_text("héllo\n", encoding="utf-8")
    assert read_text_file(good, "data file") == "héllo\n"
    with pytest.raises(DataError, match=r"^cannot read data file .*missing\.jsonl: No such file"):
        read_text_file(tmp_path / "missing.jsonl", "data file")
    binary = tmp_path / "b.jsonl"
    binary.write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(DataError, match="cannot read data file"):
        read_text_file(binary, "data file")


def test_jsonl_objects_skips_blank_lines_and_names_the_bad_line():
    assert list(jsonl_objects('{"a": 1}\n\n  \n[2]\n', "f.jsonl")) == [(1, {"a": 1}), (4, [2])]
    with pytest.raises(DataError, match=r"^f\.jsonl line 3: not valid JSON"):
        list(jsonl_objects('{"a": 1}\n\n{"a": \n', "f.jsonl"))
