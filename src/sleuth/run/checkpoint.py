"""Checkpoints that survive a crash mid-save, load with no code execution, and let a run continue
exactly where it stopped.

RUN_DIR/checkpoints/iter-000012/ holds everything the next iteration depends on:

    policy/        the trainable weights (LoRA adapter or full weights; safetensors), via Policy.save;
                   from FSDP2 ranks (TrainerGroup.save) a sharded checkpoint with the optimizer state too
    trainer.pt     optimizer and learning-rate schedule (Trainer.state_dict): tensors and plain values
    rng.json       python, numpy and torch RNG states
    state.json     iteration, data position, validation reward, loop counters
    metrics.jsonl  the run's metrics up to and including this iteration
    manifest.json  size and SHA-256 of every file above, written last

A checkpoint is written into a hidden temporary folder and put in place by `sleuth.system.fsio`, so a
process killed mid-save leaves the previous checkpoints untouched and no half-written folder under a
valid name. Loading never unpickles code: `trainer.pt` is read with `torch.load(weights_only=True)`
and the RNG states are JSON, so a crafted file in a run directory someone hands you is refused with
a one-line error instead of running. A checkpoint whose files do not match its manifest (truncated,
overwritten, bit rot) is skipped: `restore_latest` falls back to the newest one that verifies, saying
which was skipped and why. Retention keeps the last N plus the best by validation reward.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import random
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from sleuth.errors import UserError
from sleuth.system import fsio

_NAME = re.compile(r"^iter-(\d{6,})$")
STATE_FILE = "state.json"
MANIFEST_FILE = "manifest.json"
RNG_FILE = "rng.json"
TRAINER_FILE = "trainer.pt"
POLICY_DIR = "policy"


class SavesWeights(Protocol):
    def save(self, directory: str | Path) -> object: ...
    def load_weights(self, directory: str | Path) -> None: ...


class HasState(Protocol):
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class CheckpointInfo:
    path: Path
    iteration: int
    val_reward: float | None
    state: dict[str, Any] = field(default_factory=dict)


def rng_state() -> dict[str, Any]:
    """Python, numpy and torch RNG states as JSON-ready values (no pickle needed to read them)."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_manifest(folder: Path) -> None:
    """Record the size and checksum of every file in `folder` (the manifest itself excluded)."""
    files = {
        str(p.relative_to(folder)): {"size": p.stat().st_size, "sha256": _sha256(p)}
        for p in sorted(folder.rglob("*")) if p.is_file() and p.name != MANIFEST_FILE
    }
    (folder / MANIFEST_FILE).write_text(json.dumps({"format": 2, "files": files}, indent=1))


def verify_manifest(folder: Path, only: str | None = None) -> str | None:
    """Why the files of `folder` (those under its subfolder `only`, if given) do not match its
    manifest, or None when they all do."""
    try:
        manifest = json.loads((folder / MANIFEST_FILE).read_text())
        files = manifest["files"]
        if not all(isinstance(name, str) and isinstance(meta, dict) for name, meta in files.items()):
            raise TypeError("files")
    except FileNotFoundError:
        return f"no {MANIFEST_FILE} (an incomplete save, or written by an older sleuth)"
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"unreadable {MANIFEST_FILE} ({type(e).__name__})"
    if only is not None:
        files = {name: meta for name, meta in files.items() if name.startswith(only + "/")}
        if not files:
            return f"{MANIFEST_FILE} lists no {only}/ files"
    for name, meta in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != meta.get("size"):
            return f"{name} has {size} bytes, the manifest says {meta.get('size')} (truncated or overwritten)"
        if _sha256(path) != meta.get("sha256"):
            return f"{name} does not match its checksum (corrupt or modified)"
    return None


def load_tensors_file(path: Path) -> Any:
    """torch.load with no code execution; a file that would need it is refused in one line."""
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else "unsupported content"
        raise UserError(f"{path} holds objects that only code execution could load; refused "
                        f"(torch.load weights_only: {reason[:200]})") from None
    except (OSError, RuntimeError, EOFError, ValueError) as e:
        raise UserError(f"{path} is not a readable checkpoint file ({type(e).__name__})") from None


@dataclass
class LoadedCheckpoint:
    """Everything a checkpoint holds, read and checked before anything is applied."""

    info: CheckpointInfo
    trainer_state: dict[str, Any] | None
    rng: dict[str, Any] | None


class CheckpointManager:
    """Saves, lists, prunes and restores the checkpoints of one run directory."""

    def __init__(self, directory: str | Path, keep_last: int = 2,
                 warn: Callable[[str], None] | None = None) -> None:
        if keep_last < 1:
            raise ValueError("keep_last must be >= 1")
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.warn = warn or (lambda text: print(f"sleuth: warning: {text}", file=sys.stderr))

    # ------------------------------------------------------------------ listing

    def list(self) -> list[CheckpointInfo]:
        """Complete checkpoints, oldest first (temporary and half-deleted folders are ignored)."""
        if not self.directory.is_dir():
            return []
        found = []
        for child in self.directory.iterdir():
            match = _NAME.match(child.name)
            state_file = child / STATE_FILE
            if not (match and state_file.is_file()):
                continue
            try:
                state = json.loads(state_file.read_text())
            except (OSError, ValueError):
                continue
            if not isinstance(state, dict):
                continue
            val = state.get("val_reward")
            found.append(CheckpointInfo(child, int(match.group(1)),
                                        val if isinstance(val, int | float) else None, state))
        return sorted(found, key=lambda c: c.iteration)

    def latest(self) -> CheckpointInfo | None:
        items = self.list()
        return items[-1] if items else None

    def best(self) -> CheckpointInfo | None:
        """The checkpoint with the highest validation reward (the latest one among ties)."""
        scored = [c for c in self.list() if c.val_reward is not None]
        if not scored:
            return None
        return max(scored, key=lambda c: (c.val_reward, c.iteration))

    def find(self, which: str, only: str | None = None) -> CheckpointInfo:
        """'latest' (the newest that verifies), 'best', or a checkpoint folder name / path; the
        checkpoint's files (those under `only`, e.g. "policy" for a reader of the weights alone)
        are verified against its manifest."""
        if which == "latest":
            found = self.newest_valid(only)
            if found is None:
                raise UserError(f"no valid checkpoint in {self.directory}")
            return found
        if which == "best":
            found = self.best() or self.latest()
        else:
            path = Path(which)
            if not path.is_absolute() and not path.exists():
                path = self.directory / which
            found = next((c for c in self.list() if c.path.resolve() == path.resolve()), None)
        if found is None:
            raise UserError(f"no checkpoint '{which}' in {self.directory}")
        problem = verify_manifest(found.path, only)
        if problem is not None:
            raise UserError(f"checkpoint {found.path} is not usable: {problem}")
        return found

    def newest_valid(self, only: str | None = None) -> CheckpointInfo | None:
        """The newest checkpoint whose files (under `only`, if given) match its manifest; each newer
        one is reported skipped."""
        for c in reversed(self.list()):
            problem = verify_manifest(c.path, only)
            if problem is None:
                return c
            self.warn(f"skipped checkpoint {c.path.name}: {problem}")
        return None

    # ------------------------------------------------------------------ saving

    def save(
        self,
        iteration: int,
        policy: SavesWeights,
        trainer: HasState,
        state: dict[str, Any],
        metrics_file: Path | None = None,
    ) -> Path:
        """Write checkpoint `iteration` atomically, then prune old ones. Returns its folder.

        `state` must be JSON-serializable; its "val_reward" (if any) ranks the checkpoint for `best`.
        """
        final = self.directory / f"iter-{iteration:06d}"
        try:
            with fsio.atomic_folder(final) as tmp:
                policy.save(tmp / POLICY_DIR)
                torch.save(trainer.state_dict(), tmp / TRAINER_FILE)
                (tmp / RNG_FILE).write_text(json.dumps(rng_state()))
                if metrics_file is not None and metrics_file.exists():
                    (tmp / "metrics.jsonl").write_bytes(metrics_file.read_bytes())
                (tmp / STATE_FILE).write_text(json.dumps({"iteration": iteration, **state}, indent=1))
                write_manifest(tmp)  # last: a checkpoint with a manifest is complete
        except UserError as e:  # e.g. a full disk: the half-written copy is gone, older ones stay
            last = self.latest()
            kept = f"; {last.path.name} is intact and --resume continues from it" if last else ""
            raise UserError(f"{e}{kept}") from None
        self.prune()
        return final

    def prune(self) -> None:
        """Keep the last `keep_last` checkpoints and the best one; remove the rest and stale temps."""
        items = self.list()
        keep = {c.path for c in items[-self.keep_last:]}
        best = self.best()
        if best is not None:
            keep.add(best.path)
        for c in items:
            if c.path not in keep:
                fsio.delete_folder(c.path)
        fsio.clean_leftovers(self.directory)

    # ------------------------------------------------------------------ loading

    def read(self, checkpoint: CheckpointInfo, trainer: bool = True, rng: bool = True) -> LoadedCheckpoint:
        """Verify a checkpoint and read its trainer and RNG states (no code execution)."""
        problem = verify_manifest(checkpoint.path)
        if problem is not None:
            raise UserError(f"checkpoint {checkpoint.path} is not usable: {problem}")
        trainer_state = load_tensors_file(checkpoint.path / TRAINER_FILE) if trainer else None
        if trainer_state is not None and not isinstance(trainer_state, dict):
            raise UserError(f"{checkpoint.path / TRAINER_FILE} does not hold a trainer state")
        rng_value = None
        if rng:
            try:
                rng_value = json.loads((checkpoint.path / RNG_FILE).read_text())
                set_rng_state(rng_value)  # applying it is the only full check; restore applies it last
            except (OSError, ValueError, KeyError, TypeError, RuntimeError) as e:
                raise UserError(f"{checkpoint.path / RNG_FILE} is not a valid RNG state "
                                f"({type(e).__name__})") from None
        return LoadedCheckpoint(checkpoint, trainer_state, rng_value)

    def restore(self, checkpoint: CheckpointInfo, policy: SavesWeights, trainer: HasState | None,
                restore_rng: bool = True) -> dict[str, Any]:
        """Load weights, trainer state and RNG states from a checkpoint; return its state dict."""
        loaded = self.read(checkpoint, trainer=trainer is not None, rng=restore_rng)
        try:
            policy.load_weights(checkpoint.path / POLICY_DIR)
        except UserError:
            raise
        except Exception as e:  # safetensors/peft errors of a malformed file: the checkpoint is unusable
            raise UserError(f"cannot load the weights in {checkpoint.path / 'policy'} "
                            f"({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})") from None
        if trainer is not None and loaded.trainer_state is not None:
            trainer_state = loaded.trainer_state
            if "optimizer" not in trainer_state:  # FSDP2 ranks: the optimizer is sharded beside the weights
                trainer_state = {**trainer_state, "optimizer_dir": str(checkpoint.path / POLICY_DIR)}
            try:
                trainer.load_state_dict(trainer_state)
            except (KeyError, ValueError, TypeError, RuntimeError) as e:
                raise UserError(f"{checkpoint.path / TRAINER_FILE} does not fit this trainer "
                                f"({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})") from None
        if loaded.rng is not None:
            set_rng_state(loaded.rng)
        return checkpoint.state

    def restore_latest(self, policy: SavesWeights, trainer: HasState | None) -> CheckpointInfo | None:
        """Restore the newest checkpoint that verifies and loads, warning about each one skipped.

        None when the run has no checkpoint at all; a UserError when it has some but none is usable.
        """
        items = self.list()
        for c in reversed(items):
            try:
                self.restore(c, policy, trainer)
                return c
            except UserError as e:
                self.warn(f"skipped checkpoint {c.path.name}: {e}")
        if items:
            raise UserError(f"none of the {len(items)} checkpoints in {self.directory} is usable "
                            "(see the warnings above)")
        return None
