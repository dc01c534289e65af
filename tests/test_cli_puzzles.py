"""`sleuth puzzles generate | show | stats` through the real entry point, exit codes included."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sleuth.cli import main
from sleuth.system.datafiles import data_path
from sleuth.tasks.temporal_clue.generate import generate_puzzle, puzzle_seed

PUBLISHED = data_path("temporal_clue_val")


def test_generate_writes_jsonl_then_show_and_stats_read_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "p.jsonl"
    assert main(["puzzles", "generate", "--n", "3", "--seed", "4", "--difficulty", "2", "--workers", "1",
                 "--out", str(out), "--quiet"]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 3 and records[2] == generate_puzzle(puzzle_seed(4, 2), 2)
    capsys.readouterr()

    assert main(["puzzles", "show", str(out), "--index", "1"]) == 0
    shown = capsys.readouterr().out
    assert records[1]["prompt"] in shown
    for letter, answer in records[1]["solution"].items():
        assert f"\n{letter}. {answer}\n" in shown + "\n"

    assert main(["puzzles", "stats", str(out)]) == 0
    table = capsys.readouterr().out
    for field in ("suspects", "weapons", "rooms", "times", "clues", "questions", "3 puzzles"):
        assert field in table


@pytest.mark.parametrize("rung", ["lookup", "elim1", "elim2", "1", "6"])
def test_generate_produces_every_rung(rung: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.jsonl"
    assert main(["puzzles", "generate", "--n", "2", "--seed", "5", "--difficulty", rung, "--workers", "1",
                 "--list-choices", "--out", str(out), "--quiet"]) == 0
    assert f"(difficulty {rung}, seed 5)" in capsys.readouterr().out
    records = [json.loads(line) for line in out.read_text().splitlines()]
    level = int(rung) if rung.isdigit() else rung
    assert [r["difficulty"] for r in records] == [level, level]
    assert records[1] == generate_puzzle(puzzle_seed(5, 1), rung, list_choices=True)


def test_list_choices_flag_reaches_the_prompt(tmp_path: Path) -> None:
    out = tmp_path / "c.jsonl"
    assert main(["puzzles", "generate", "--n", "1", "--workers", "1", "--out", str(out), "--list-choices",
                 "--quiet"]) == 0
    assert "(choose from: " in json.loads(out.read_text())["prompt"]


def test_stats_and_show_read_the_published_json_list(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["puzzles", "stats", str(PUBLISHED)]) == 0
    table = capsys.readouterr().out
    assert "64 puzzles" in table
    row = next(line for line in table.splitlines() if "suspects" in line)
    assert "2" in row and "10" in row
    assert main(["puzzles", "show", str(PUBLISHED), "--index", "63"]) == 0
    assert "Best of luck, detective." in capsys.readouterr().out


@pytest.mark.parametrize("argv", [
    ["puzzles", "generate", "--n", "0"],
    ["puzzles", "generate", "--difficulty", "-3"],
    ["puzzles", "generate", "--difficulty", "7"],
    ["puzzles", "generate", "--difficulty", "elim3"],
    ["puzzles", "generate", "--workers", "0"],
])
def test_bad_generate_arguments_exit_2_with_one_line(argv: list[str], tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*argv, "--out", str(tmp_path / "x.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sleuth: error: --") and err.count("\n") == 1
    assert not (tmp_path / "x.jsonl").exists()


def test_output_in_a_missing_folder_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["puzzles", "generate", "--n", "1", "--workers", "1", "--out", str(tmp_path / "no" / "x.jsonl")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_non_integer_flag_is_an_argparse_error_exit_2() -> None:
    with pytest.raises(SystemExit) as e:
        main(["puzzles", "generate", "--n", "many"])
    assert e.value.code == 2


def test_unreadable_and_malformed_files_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "x", "solution": {"A": "y"}}\n{not json\n')
    wrong = tmp_path / "wrong.json"
    wrong.write_text('[{"prompt": 3}]')
    cases = [tmp_path / "missing.jsonl", tmp_path, broken, wrong]
    for path in cases:
        for argv in (["puzzles", "stats", str(path)], ["puzzles", "show", str(path)]):
            assert main(argv) == 2, path
            err = capsys.readouterr().err
            assert err.startswith("sleuth: error: ") and err.count("\n") == 1


def test_show_index_out_of_range_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"num_clues": 1, "prompt": "p", "solution": {"A": "x"}}) + "\n")
    for index in ("1", "-1"):
        assert main(["puzzles", "show", str(good), "--index", index]) == 2
        assert "out of range" in capsys.readouterr().err


def test_out_that_is_a_folder_fails_before_generating(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "puzzles.jsonl").write_text("kept\n")
    assert main(["puzzles", "generate", "--n", "1", "--workers", "1", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--out {tmp_path} is a folder" in err
    assert (tmp_path / "puzzles.jsonl").read_text() == "kept\n"


def test_existing_file_is_replaced_whole(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "p.jsonl"
    out.write_text("old\n")
    assert main(["puzzles", "generate", "--n", "2", "--workers", "1", "--quiet", "--out", str(out)]) == 0
    assert len(out.read_text().splitlines()) == 2 and [p.name for p in tmp_path.iterdir()] == ["p.jsonl"]
