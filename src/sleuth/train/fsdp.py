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
import os
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from sleuth.config import AlgorithmConfig, TrainerConfig
from sleuth.errors import ConfigError, UserError
from sleuth.records import Completion, Group, Problem
from sleuth.train.packing import PackedBatch, PackedRow, pack_groups
from sleuth.train.policy import ADAPTER, Policy
from sleuth.train.sharded import named_optimizer_state
from sleuth.train.step import Trainer


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


def check_shardable(quantization: str) -> None:
    """FSDP2 shards float parameters: a quantized base cannot be sharded (the one home of this rule)."""
    if quantization != "none":
        raise ConfigError(f"model.quantization={quantization} with cluster.trainer_workers > 1: FSDP2 shards "
                          "float parameters; use one trainer worker or model.quantization=none")


def shard_policy(policy: Policy) -> None:
    """fully_shard each decoder layer and the root of the policy (and of its frozen reference).

    On GPU: float32 sharded parameters, bf16 compute, float32 gradient reduction; on CPU float32
    throughout. Gradients are summed over ranks (the loss weights are already global).
    """
    check_shardable(policy.model_cfg.quantization)
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


