"""docs/architecture.md stays true: every module of src/sleuth has its line there."""

from __future__ import annotations

from pathlib import Path

import sleuth

SRC = Path(sleuth.__file__).parent
DOC = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


def test_every_module_is_in_the_architecture_doc() -> None:
    text = DOC.read_text()
    missing = []
    for f in sorted(SRC.rglob("*.py")):
        if f.name in {"__init__.py", "__main__.py"}:
            continue
        rel = f.relative_to(SRC)
        named = f"`{f.stem}`" in text if rel.parts[0] == "cli" else f"{f.name}" in text
        if not named:
            missing.append(str(rel))
    assert missing == []


def test_every_folder_has_a_section() -> None:
    text = DOC.read_text()
    folders = sorted(p.name for p in SRC.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    assert [f for f in folders if f"{f}/" not in text] == []
