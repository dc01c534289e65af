"""Dependencies point one way (docs/architecture.md): every package of src/sleuth sits at one place
in ORDER and imports only itself and the packages before it. Checked on the source's import
statements, lazy imports inside functions included; imports under `if TYPE_CHECKING:` are
annotations only and not counted. No two modules import each other, directly or round a circle."""

from __future__ import annotations

import ast
from pathlib import Path

import sleuth

SRC = Path(sleuth.__file__).parent
CORE = {"records", "config", "section", "task_config", "cluster_config", "errors", "plugins", "__init__", "__main__", "__version__"}
"""Flat modules every stage may use: shared types, the config schema, errors, the registry type."""
ORDER = ["core", "system", "tasks", "rollout", "gateway", "rewards", "train", "run", "eval", "cluster",
         "loop", "testing", "cli"]
"""The data flow (tasks -> rollout -> rewards -> train -> the loop), with the helpers each stage uses
before it: system (hardware, model folders, files, seeds) below everything, run (checkpoints,
metrics) and eval below the loop that schedules them, cluster (stages as Ray actors) below the loop."""


def unit(module: str) -> str:
    """'sleuth.rollout.base' -> 'rollout'; flat core modules -> 'core'."""
    top = module.split(".")[1] if module.startswith("sleuth.") else "__init__"
    if top == "__main__":
        return "cli"
    return "core" if top in CORE else top


def runtime_imports(path: Path) -> set[str]:
    """Every sleuth module a file imports (from x import y -> x.y when that is a module)."""
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.startswith("sleuth"):
                found |= {f"{node.module}.{a.name}" if _is_module(f"{node.module}.{a.name}") else node.module
                          for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("sleuth.")}
    return found


def _is_module(name: str) -> bool:
    rel = Path(*name.split(".")[1:])
    return (SRC / rel).with_suffix(".py").is_file() or (SRC / rel / "__init__.py").is_file()


def module_name(path: Path) -> str:
    return ".".join(("sleuth", *path.relative_to(SRC).with_suffix("").parts)).removesuffix(".__init__")


def test_every_package_has_a_place_in_the_order() -> None:
    packages = {p.name for p in SRC.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    flat = {p.stem for p in SRC.glob("*.py")}
    assert packages <= set(ORDER), sorted(packages - set(ORDER))
    assert flat <= CORE, sorted(flat - CORE)


def test_stages_import_only_what_comes_before_them() -> None:
    bad = []
    for f in sorted(SRC.rglob("*.py")):
        me = ORDER.index(unit(module_name(f)))
        for target in runtime_imports(f):
            if target != "sleuth" and ORDER.index(unit(target)) > me:
                bad.append(f"{f.relative_to(SRC)} imports {target}")
    assert bad == []


def test_no_import_circle() -> None:
    graph = {module_name(f): {t for t in runtime_imports(f) if _is_module(t)} for f in SRC.rglob("*.py")}
    state: dict[str, int] = {}
    circles: list[str] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in graph.get(node, ()):
            if state.get(nxt) == 1:
                circles.append(" -> ".join([*path[path.index(nxt):], nxt]))
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    # a package's __init__ importing its own modules is how packages work, not a circle
    circles = [c for c in circles if not all(m.startswith(c.split(" -> ")[0] + ".") or m == c.split(" -> ")[0]
                                             for m in c.split(" -> "))]
    assert circles == []


def test_the_check_sees_lazy_imports(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text("import sleuth.records\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                 "    from sleuth.cli import main\n\ndef g():\n    from sleuth.train.step import Trainer\n"
                 "    from sleuth.loop.checks import check_run\n")
    assert {unit(m) for m in runtime_imports(f)} == {"core", "train", "loop"}
