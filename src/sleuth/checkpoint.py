"""Checkpoints that survive a crash mid-save and let a run continue exactly where it stopped.

RUN_DIR/checkpoints/iter-000012/ holds everything the next iteration depends on:

    policy/        the trainable weights (LoRA adapter or full weights), via Policy.save
    trainer.pt     optimizer and learning-rate schedule (Trainer.state_dict)
    rng.pt         python, numpy and torch RNG states
    state.json     iteration, data position, validation reward, loop counters
    metrics.jsonl  the run's metrics up to and including this iteration

A checkpoint is written into a hidden temporary folder next to its final place and renamed in one
`os.replace`, so a process killed mid-save leaves the previous checkpoints untouched and no
half-written folder that looks complete. Retention keeps the last N plus the best by validation reward.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from sleuth.errors import UserError

_NAME = re.compile(r"^iter-(\d{6,})$")
STATE_FILE = "state.json"


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
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _remove_tree(path: Path) -> None:
    """Delete a folder so that an interruption never leaves a partial folder under a valid name."""
    if not path.exists():
        return
    doomed = path.with_name(f".deleting-{path.name}-{os.getpid()}")
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


class CheckpointManager:
    """Saves, lists, prunes and restores the checkpoints of one run directory."""

    def __init__(self, directory: str | Path, keep_last: int = 2) -> None:
        if keep_last < 1:
            raise ValueError("keep_last must be >= 1")
        self.directory = Path(directory)
        self.keep_last = keep_last

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
            except (OSError, json.JSONDecodeError):
                continue
            found.append(CheckpointInfo(child, int(match.group(1)), state.get("val_reward"), state))
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

    def find(self, which: str) -> CheckpointInfo:
        """'latest', 'best', or a checkpoint folder name / path."""
        if which == "latest":
            found = self.latest()
        elif which == "best":
            found = self.best() or self.latest()
        else:
            path = Path(which)
            if not path.is_absolute() and not path.exists():
                path = self.directory / which
            found = next((c for c in self.list() if c.path.resolve() == path.resolve()), None)
        if found is None:
            raise UserError(f"no checkpoint '{which}' in {self.directory}")
        return found

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
        self.directory.mkdir(parents=True, exist_ok=True)
        final = self.directory / f"iter-{iteration:06d}"
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=self.directory))
        try:
            policy.save(tmp / "policy")
            torch.save(trainer.state_dict(), tmp / "trainer.pt")
            torch.save(rng_state(), tmp / "rng.pt")
            if metrics_file is not None and metrics_file.exists():
                shutil.copyfile(metrics_file, tmp / "metrics.jsonl")
            (tmp / STATE_FILE).write_text(json.dumps({"iteration": iteration, **state}, indent=1))
            _fsync_tree(tmp)
            # A folder of the same name only exists when an iteration is re-saved after a resume;
            # move it aside first because os.replace cannot overwrite a non-empty folder.
            _remove_tree(final)
            os.replace(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
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
                _remove_tree(c.path)
        for child in self.directory.iterdir():
            # Leftovers of a save or delete that a killed process never finished.
            if child.name.startswith((".tmp-", ".deleting-")) and not _owned_by_live_process(child):
                shutil.rmtree(child, ignore_errors=True)

    # ------------------------------------------------------------------ loading

    def restore(self, checkpoint: CheckpointInfo, policy: SavesWeights, trainer: HasState | None,
                restore_rng: bool = True) -> dict[str, Any]:
        """Load weights, trainer state and RNG states from a checkpoint; return its state dict."""
        policy.load_weights(checkpoint.path / "policy")
        if trainer is not None:
            trainer_state = torch.load(checkpoint.path / "trainer.pt", weights_only=False)
            if "optimizer" not in trainer_state:  # FSDP2 ranks: it is sharded beside the weights
                trainer_state["optimizer_dir"] = str(checkpoint.path / "policy")
            trainer.load_state_dict(trainer_state)
        if restore_rng:
            set_rng_state(torch.load(checkpoint.path / "rng.pt", weights_only=False))
        return checkpoint.state


def _owned_by_live_process(path: Path) -> bool:
    # A ".deleting-NAME-PID" folder of another live process is still being removed by it.
    pid = path.name.rsplit("-", 1)[-1]
    if not path.name.startswith(".deleting-") or not pid.isdigit() or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except OSError:
        return False
    return True


def _fsync_tree(root: Path) -> None:
    """Flush file contents to disk before the rename makes the checkpoint visible."""
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
