"""FSDP2 trainer ranks: the same step as step.py, with the policy sharded over a process group.

    init_distributed(rank, world_size, master_addr, master_port)   # gloo on CPU, NCCL on GPU
    trainer = FSDPTrainer(policy, cfg.algorithm, cfg.trainer, total_steps, max_tokens)
    metrics = trainer.step(groups)          # every rank gets the same groups
    save_checkpoint(dir, policy, trainer)   # sharded (torch.distributed.checkpoint), collective
    with gathered(policy): ...              # full weights on every rank, e.g. policy.sync_state()

`fully_shard` wraps each decoder layer and the root (`Policy.row_model`, which holds embeddings,
final norm and lm_head); a frozen base (LoRA) and a frozen reference copy are sharded too. On GPU
parameters stay float32 and compute runs in bf16 with float32 gradient reduction.

Every rank packs the whole batch the same way (packing is deterministic), then runs its share of
the rows, balanced by token count. The per-token loss weights come from the whole batch, so the
sum over ranks of each rank's loss is the single-process loss; gradients are summed (not averaged)
over ranks, which makes the update independent of the number of ranks. A rank with fewer rows
runs empty micro-steps so that all ranks make the same collective calls.

Checkpoints hold the trainable parameters and the optimizer state under the policy's parameter
names; torch.distributed.checkpoint reshards them on load, so a checkpoint written by N ranks loads
into M ranks or into one plain process (no process group).
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from sleuth.config import AlgorithmConfig, TrainerConfig
from sleuth.errors import UserError
from sleuth.records import Completion, Group, Problem
from sleuth.train.packing import PackedBatch, PackedRow, pack_groups
from sleuth.train.policy import ADAPTER, Policy
from sleuth.train.step import Trainer

CHECKPOINT_OPTIONS = StateDictOptions(ignore_frozen_params=True)
"""Checkpoints hold what training changes: the adapter with LoRA (the base comes from model.path)."""
LOAD_OPTIONS = StateDictOptions(ignore_frozen_params=True, strict=False)
"""Loading leaves the frozen base alone; dcp.load already fails on a trainable key the checkpoint lacks."""


def init_distributed(rank: int, world_size: int, master_addr: str, master_port: int,
                     timeout_s: float = 600.0) -> torch.device:
    """Join the default process group (NCCL on GPU, gloo on CPU); returns this rank's device.

    On GPU each rank is expected to see its own device (Ray sets CUDA_VISIBLE_DEVICES per actor),
    so the device is `cuda:LOCAL_RANK` (0 when unset).
    """
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if cuda else "gloo", init_method=f"tcp://{master_addr}:{master_port}", rank=rank,
        world_size=world_size, timeout=timedelta(seconds=timeout_s),
        **({"device_id": device} if cuda else {}),
    )
    return device


def decoder_layers(lm: Any) -> list[torch.nn.Module]:
    """The decoder layers of a transformers CausalLM (`lm.model.layers`)."""
    layers = getattr(getattr(lm, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) == 0:
        raise UserError(f"FSDP2 sharding: {type(lm).__name__} has no decoder layers at .model.layers")
    return list(layers)


def shard_policy(policy: Policy) -> None:
    """fully_shard each decoder layer and the root of the policy (and of its frozen reference).

    On GPU: float32 sharded parameters, bf16 compute, float32 gradient reduction; on CPU float32
    throughout. Gradients are summed over ranks (the loss weights are already global).
    """
    if policy.model_cfg.quantization != "none":
        raise UserError(f"model.quantization={policy.model_cfg.quantization} is not supported with FSDP2 "
                        "trainer ranks (cluster.trainer_workers > 1): FSDP2 shards float parameters")
    roots = [policy.row_model]
    if policy.reference_row_model is not None:
        roots.append(policy.reference_row_model)
    mp = MixedPrecisionPolicy()
    if policy.device.type == "cuda":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for root in roots:
            root.float()  # the sharded master weights; bf16 copies are gathered for compute
        policy.compute_dtype = torch.bfloat16
    for root in roots:
        for layer in decoder_layers(root.lm):
            fully_shard(layer, mp_policy=mp)
        fully_shard(root, mp_policy=mp)
        for module in root.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                # Gloo has no pre-multiplied sum; a factor of 1 makes the plain sum exact anyway.
                module.set_force_sum_reduction_for_comms(policy.device.type != "cuda")


def balance_rows(rows: list[PackedRow], world_size: int) -> list[list[int]]:
    """Row indices per rank: largest rows first, each to the rank with the fewest tokens so far.

    Deterministic (ties go to the lower index and rank), so every rank computes the same split.
    Each rank's rows keep their batch order.
    """
    loads = [0] * world_size
    shares: list[list[int]] = [[] for _ in range(world_size)]
    for i in sorted(range(len(rows)), key=lambda i: (-rows[i].n_real_tokens, i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        shares[rank].append(i)
        loads[rank] += rows[i].n_real_tokens
    return [sorted(s) for s in shares]


def empty_row(pad_to_multiple: int = 1) -> PackedRow:
    """A two-token row (one prompt token, one completion token, advantage 0) for empty micro-steps."""
    group = Group(Problem("empty-micro-step", [], None), [0], [Completion([0], [0], [0.0], "stop", "")], [0.0])
    return pack_groups([group], 16, pad_to_multiple=pad_to_multiple).rows[0]


class FSDPTrainer(Trainer):
    """Trainer over a policy sharded with FSDP2 across the default process group (one per rank)."""

    def __init__(self, policy: Policy, algorithm_cfg: AlgorithmConfig, trainer_cfg: TrainerConfig,
                 total_steps: int | None = None, max_tokens: int = 256, peak_flops: float | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("FSDPTrainer needs a process group (init_distributed)")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        shard_policy(policy)  # before the optimizer: it must hold the sharded parameters
        super().__init__(policy, algorithm_cfg, trainer_cfg, total_steps, max_tokens, peak_flops)
        self._empty: PackedRow | None = None
        self.last_shares: list[list[int]] = []
        """Row indices per rank of the latest pass (for tests and metrics)."""

    def state_dict(self) -> dict[str, Any]:
        """Schedule and counters; the optimizer state is sharded (save_checkpoint writes it)."""
        state = super().state_dict()
        del state["optimizer"]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Schedule and counters; a single-process optimizer state (Trainer.state_dict) is sharded
        here. A sharded optimizer state comes with the weights (load_checkpoint)."""
        if "optimizer" in state:
            set_optimizer_state_dict(self.policy.model, self.optimizer,
                                     named_optimizer_state(state["optimizer"], self.policy),
                                     options=StateDictOptions(full_state_dict=True))
        self.scheduler.load_state_dict(state["scheduler"])
        self.step_count = int(state["step_count"])
        self.self_checked = bool(state.get("self_checked", True))

    # ------------------------------------------------------------------ hooks of the step

    def _micro_rows(self, batch: PackedBatch) -> list[PackedRow | None]:
        shares = balance_rows(batch.rows, self.world_size)
        self.last_shares = shares
        mine = [batch.rows[i] for i in shares[self.rank]]
        steps = max(len(s) for s in shares)
        return [*mine, *([None] * (steps - len(mine)))]

    def _empty_row(self) -> PackedRow:
        if self._empty is None:
            self._empty = empty_row(self._pad_multiple())
        return self._empty

    def _reduce_sums(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.policy.device)
        dist.all_reduce(t)
        return t.tolist()

    def _clip_grad_norm(self) -> float:
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
        return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)

    def _check_rows(self, batch: PackedBatch) -> list[PackedRow]:
        # Every rank checks rank 0's slice: the forwards gather shards, so all ranks run the same ones.
        return [batch.rows[i] for i in balance_rows(batch.rows, self.world_size)[0]] or batch.rows


# ---------------------------------------------------------------------- full weights


@contextlib.contextmanager
def gathered(policy: Policy) -> Iterator[Policy]:
    """Unshard every FSDP2 module of the policy (collective), so its parameters are whole tensors.

    Inside, `policy.sync_state()`, `policy.export_merged(dir)` and the adapter tensors work as on a
    single process. Costs one full copy of the weights per rank while open. A no-op unsharded.
    """
    modules = [m for m in policy.row_model.modules() if isinstance(m, FSDPModule)]
    for m in modules:
        m.unshard()
    try:
        yield policy
    finally:
        for m in modules:
            m.reshard()


# ---------------------------------------------------------------------- checkpoints


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


def load_full_weights(directory: str | Path, policy: Policy) -> None:
    """What Policy.save wrote (a single process's checkpoint) into a sharded policy.

    Every rank reads the whole file and keeps its own shards (set_model_state_dict).
    """
    from safetensors.torch import load_file

    src = Path(directory)
    files = [src / "adapter_model.safetensors"] if policy.is_lora else sorted(src.glob("*.safetensors"))
    if not files or not files[0].is_file():
        raise UserError(f"{src} has no {'adapter_model' if policy.is_lora else '*'}.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(f))
    if policy.is_lora:  # PEFT saves adapter weights without the adapter's name; the model has it
        state = {k.replace(".lora_A.", f".lora_A.{ADAPTER}.").replace(".lora_B.", f".lora_B.{ADAPTER}."): v
                 for k, v in state.items()}
    known = {name for name, _ in policy.model.named_parameters()}
    unexpected = sorted(set(state) - known)
    if unexpected:
        raise UserError(f"weights in {src} do not match the model (unexpected {unexpected[:3]})")
    set_model_state_dict(policy.model, state, options=StateDictOptions(full_state_dict=True, strict=False))


def named_optimizer_state(state: dict[str, Any], policy: Policy) -> dict[str, Any]:
    """A torch optimizer state dict (parameters by position) keyed by parameter name instead.

    Positions follow Policy.trainable_parameters(), the order the Trainer gave its optimizer.
    """
    names = [name for name, p in policy.model.named_parameters() if p.requires_grad]
    groups = []
    for group in state["param_groups"]:
        groups.append({**group, "params": [names[i] for i in group["params"]]})
    return {"state": {names[i]: s for i, s in state["state"].items()}, "param_groups": groups}
