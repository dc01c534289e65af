"""Dependencies point one way (docs/architecture.md): the rollout stage never imports the training
stage or anything after it, and the training stage never imports the rollout stage. Checked on the
source's import statements, lazy imports inside functions included."""

from __future__ import annotations

import ast
from pathlib import Path

import sleuth

SRC = Path(sleuth.__file__).parent
LATER = {"loop", "cluster", "sampling", "overlap", "sync", "evaluate", "cli", "gateway"}
FORBIDDEN = {
    "rollout": LATER | {"train", "scoring", "tasks"},
    "train": LATER | {"rollout", "scoring", "tasks"},
    "tasks/temporal_clue": LATER | {"rollout", "train"},
    "attention.py": LATER | {"rollout", "train"},
}


def imported_units(path: Path) -> set[str]:
    """The top-level sleuth modules or packages a file imports (sleuth.x.y -> x)."""
    units = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] if node.module != "sleuth" else [f"sleuth.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        units |= {n.split(".")[1] for n in names if n.startswith("sleuth.")}
    return units


def test_stages_import_only_what_comes_before_them() -> None:
    bad = []
    for where, forbidden in FORBIDDEN.items():
        files = [SRC / where] if where.endswith(".py") else sorted((SRC / where).rglob("*.py"))
        assert files and all(f.exists() for f in files), where
        for f in files:
            wrong = imported_units(f) & forbidden
            if wrong:
                bad.append(f"{f.relative_to(SRC)} imports {sorted(wrong)}")
    assert bad == []


def test_the_check_sees_lazy_imports(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text("import sleuth.records\n\ndef g():\n    from sleuth.train.step import Trainer\n"
                 "    from sleuth import loop\n")
    assert imported_units(f) == {"records", "train", "loop"}
