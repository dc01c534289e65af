"""Sharded checkpoints (torch.distributed.checkpoint): trainable parameters and optimizer state under
the policy's parameter names, written by any number of FSDP2 ranks (or one plain process) and
resharded on load. The index is read without running code.

    save_checkpoint(dir, policy, trainer)   # collective when a process group is up
    load_checkpoint(dir, policy[, trainer])
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from sleuth.errors import UserError

if TYPE_CHECKING:
    from sleuth.train.policy import Policy
    from sleuth.train.step import Trainer

CHECKPOINT_OPTIONS = StateDictOptions(ignore_frozen_params=True)
"""Checkpoints hold what training changes: the adapter with LoRA (the base comes from model.path)."""
LOAD_OPTIONS = StateDictOptions(ignore_frozen_params=True, strict=False)
"""Loading leaves the frozen base alone; dcp.load already fails on a trainable key the checkpoint lacks."""


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's `.metadata` index (plain dataclasses) and refuses anything else, so a crafted
    file in a run directory cannot run code (torch's own reader uses plain pickle.load)."""

    _DCP = frozenset({"torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
                      "torch.distributed.checkpoint.planner"})
    _BUILTINS = frozenset({("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
                           ("builtins", "slice"), ("torch", "Size"), ("pathlib", "PosixPath"),
                           ("torch.serialization", "_get_layout")})

    def find_class(self, module: str, name: str) -> Any:
        if module in self._DCP or (module, name) in self._BUILTINS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype | torch.memory_format):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint index")


class SafeFileSystemReader(dcp.FileSystemReader):
    """dcp.FileSystemReader whose metadata is read without code execution (tensor data already is:
    torch reads it with weights_only=True)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self.path) / ".metadata"
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, ValueError) as e:
            raise UserError(f"{path} is not a checkpoint index that loads without running code; "
                            f"refused ({type(e).__name__}: {e})") from None
        if not isinstance(metadata, Metadata):
            raise UserError(f"{path} does not hold a checkpoint index")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """Non-tensor values (optimizer hyper-parameters) are checked to load with weights_only=True
    before torch's planner loads the same bytes (it would accept any pickle)."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise UserError(f"checkpoint value {read_item.dest_index.fqn} needs code execution to load; "
                            f"refused ({str(e).strip().splitlines()[0][:200]})") from None
        value.seek(0)
        super().load_bytes(read_item, value)


def _load(state: dict[str, Any], directory: str | Path) -> None:
    reader = SafeFileSystemReader(str(directory))
    reader.read_metadata()  # a refused index raises UserError here (dcp.load would wrap it)
    dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner())


def is_sharded_checkpoint(directory: str | Path) -> bool:
    """Whether `directory` was written by torch.distributed.checkpoint (save_checkpoint)."""
    return (Path(directory) / ".metadata").is_file()


def save_checkpoint(directory: str | Path, policy: Policy, trainer: Trainer) -> None:
    """Trainable parameters and optimizer state, sharded (each rank writes its shards).

    Collective when a process group is up; a plain process writes the same format alone.
    The schedule and counters are in `trainer.state_dict()` (small, saved by the caller).
    """
    model_sd, optim_sd = get_state_dict(policy.model, trainer.optimizer, options=CHECKPOINT_OPTIONS)
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(directory))


def load_checkpoint(directory: str | Path, policy: Policy, trainer: Trainer | None = None) -> None:
    """Load what save_checkpoint wrote (by any number of ranks) into this policy (and optimizer)."""
    if not is_sharded_checkpoint(directory):
        raise UserError(f"{directory} is not a sharded checkpoint (no .metadata)")
    if trainer is None:
        model_sd = get_model_state_dict(policy.model, options=CHECKPOINT_OPTIONS)
        state: dict[str, Any] = {"model": model_sd}
        _load(state, directory)
        set_model_state_dict(policy.model, state["model"], options=LOAD_OPTIONS)
        return
    model_sd, optim_sd = get_state_dict(policy.model, trainer.optimizer, options=CHECKPOINT_OPTIONS)
    state = {"model": model_sd, "optimizer": optim_sd}
    _load(state, directory)
    set_state_dict(policy.model, trainer.optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"], options=LOAD_OPTIONS)




def named_optimizer_state(state: dict[str, Any], policy: Policy) -> dict[str, Any]:
    """A torch optimizer state dict (parameters by position) keyed by parameter name instead.

    Positions follow Policy.trainable_parameters(), the order the Trainer gave its optimizer.
    """
    names = [name for name, p in policy.model.named_parameters() if p.requires_grad]
    groups = []
    for group in state["param_groups"]:
        groups.append({**group, "params": [names[i] for i in group["params"]]})
    return {"state": {names[i]: s for i, s in state["state"].items()}, "param_groups": groups}
