"""Reading user data files: one-line DataErrors that name the file and the line; the data sets
shipped inside the package by their short names (src/sleuth/data/NOTICE.md)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sleuth.errors import DataError

SHIPPED = {"aime2024": "aime2024.jsonl", "temporal_clue_val": "temporal_clue_val.json"}
"""Short name -> file in src/sleuth/data: what a config may name instead of a path."""


def data_path(path: str | Path) -> Path:
    """A data file's path: a shipped data set's short name (when no such file exists here), else
    the path as given."""
    p = Path(path)
    if str(path) in SHIPPED and not p.exists():
        return Path(__file__).resolve().parents[1] / "data" / SHIPPED[str(path)]
    return p


def read_text_file(path: str | Path, what: str) -> str:
    """A UTF-8 text file's contents, or a DataError naming `what` and the path on one line. A
    shipped data set's short name (SHIPPED) reads that set."""
    p = data_path(path)
    try:
        return p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise DataError(f"cannot read {what} {p}: {reason}") from None


def jsonl_objects(text: str, where: str) -> Iterator[tuple[int, Any]]:
    """(line number, parsed value) for every non-blank line of JSONL text; `where` names the file
    in the DataError raised for a line that is not valid JSON."""
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield lineno, json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where} line {lineno}: not valid JSON ({e.msg})") from None
