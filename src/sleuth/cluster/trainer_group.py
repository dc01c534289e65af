"""FSDP2 trainer ranks as Ray actors, behind the single-process trainer's interface.

    group = TrainerGroup.from_config(cfg, placement, run_dir / "checkpoints", seed)
    metrics = group.step(groups)                     # like Trainer.step (rank 0's metrics)
    WeightSync(group, engine).push()                 # merged weights (or the adapter) gathered on rank 0
    checkpoints.save(i, group, group, state)         # group.save(dir): sharded; group.state_dict()
    checkpoints.restore(latest, group, group)        # written by any number of ranks, or by one process
    group.export_merged(out_dir)                     # one plain HF folder
    group.close()

In the loop (loop.py, cluster.trainer_workers > 1) the group stands where the one-process Policy
and Trainer stand: it has their interfaces for the step, the weight sync (sync.WeightSource),
checkpoints and export, and a tokenizer; the driver never loads the weights.

Each actor is one rank: it joins a gloo (CPU) or NCCL (GPU) process group whose address is rank 0's
node and a free port there, builds the policy from the config with the same seed as every other
rank (identical LoRA init), and shards it with FSDP2 (train/fsdp.py). Every call goes to all ranks
(the step and the gathers are collective). A rank that dies stops the run: TrainerRankDied names
the rank and the checkpoint to resume from, and the surviving ranks (stuck in a collective with
the dead one) are killed rather than left to time out.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from sleuth.cluster.runtime import Assignment
from sleuth.config import Config
from sleuth.errors import UserError
from sleuth.records import Group, LoraAdapter


class TrainerRankDied(UserError):
    """A trainer rank's process died or failed: the run stops (one line: rank and checkpoint)."""


class TrainerRank:
    """One FSDP2 rank (the body of a Ray actor): a sharded Policy and its FSDPTrainer."""

    def __init__(self, cfg: dict[str, Any], rank: int, world_size: int, total_steps: int | None,
                 max_tokens: int, seed: int, threads: int) -> None:
        import torch

        torch.set_num_threads(max(1, threads))
        self.cfg = Config.model_validate(cfg)
        if self.cfg.loop.deterministic:  # as the driver sets it for a one-process run (loop.py)
            torch.use_deterministic_algorithms(True, warn_only=True)
        self.rank, self.world_size = rank, world_size
        self.total_steps, self.max_tokens, self.seed = total_steps, max_tokens, seed
        self.policy: Any = None
        self.trainer: Any = None
        self.sender: Any = None
        """Rank 0's end of the weight broadcast group to the rollout workers (cluster/collective.py)."""

    def pid(self) -> int:
        return os.getpid()

    def address(self) -> tuple[str, int]:
        """This node's IP and a free TCP port on it (rank 0's is the process group's address)."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    def setup(self, master_addr: str, master_port: int, timeout_s: float) -> None:
        import torch

        from sleuth.train.fsdp import FSDPTrainer, init_distributed
        from sleuth.train.policy import Policy

        device = init_distributed(self.rank, self.world_size, master_addr, master_port, timeout_s)
        torch.manual_seed(self.seed)  # the same LoRA initialisation on every rank
        cfg = self.cfg
        self.policy = Policy.from_config(cfg.model, need_reference=cfg.algorithm.kl_beta > 0, device=device)
        self.trainer = FSDPTrainer(self.policy, cfg.algorithm, cfg.trainer, total_steps=self.total_steps,
                                   max_tokens=self.max_tokens)

    def adapter_is_portable(self) -> bool:
        return bool(self.policy.adapter_is_portable)

    def step(self, groups: list[Group]) -> dict[str, float]:
        return self.trainer.step(groups)

    def state_dict(self) -> dict[str, Any]:
        return self.trainer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.trainer.load_state_dict(state)

    def save(self, directory: str) -> None:
        from sleuth.train.sharded import save_checkpoint

        save_checkpoint(directory, self.policy, self.trainer)

    def load(self, directory: str) -> None:
        """A sharded checkpoint (weights + optimizer), or a single process's saved weights (the
        optimizer state of those comes through load_state_dict)."""
        from sleuth.train.fsdp import load_full_weights
        from sleuth.train.sharded import is_sharded_checkpoint, load_checkpoint

        if is_sharded_checkpoint(directory):
            load_checkpoint(directory, self.policy, self.trainer)
        else:
            load_full_weights(directory, self.policy)

    def greedy_probe(self, prompt_ids: list[int], n: int) -> tuple[list[int], Any] | None:
        """The weight-sync check's probe (Policy.greedy_probe) on rank 0, None elsewhere; collective
        (every rank runs the same forwards: FSDP2 gathers each layer's shards for them)."""
        probe = self.policy.greedy_probe(prompt_ids, n)
        return probe if self.rank == 0 else None

    def sync_state(self) -> list[tuple[str, Any]] | None:
        """Full merged weights (HF names) on rank 0, None elsewhere; collective."""
        from sleuth.train.fsdp import gathered

        with gathered(self.policy):
            if self.rank != 0:
                return None
            return [(n, t.detach().to("cpu", copy=True)) for n, t in self.policy.sync_state()]

    def lora_adapter(self) -> LoraAdapter | None:
        """The adapter (Policy.lora_adapter) on rank 0, None elsewhere or without LoRA; collective.

        Its state dict holds DTensor shards under FSDP2: every rank joins each full_tensor()
        gather (in the same order), and only plain tensors leave the rank."""
        from torch.distributed.tensor import DTensor

        if not self.policy.is_lora:
            return None
        adapter = self.policy.lora_adapter()
        whole = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in adapter.tensors.items()}
        if self.rank != 0:  # it joined the gathers; only rank 0's copy leaves
            return None
        return dataclasses.replace(adapter, tensors={k: v.to("cpu", copy=True) for k, v in whole.items()})

    # -- the weight broadcast group (rank 0 is its sender; cluster/collective.py's Sender protocol)

    def host_weight_group(self, world: int, backend: str, timeout_s: float) -> tuple[str, int]:
        from sleuth.cluster.collective import WeightSender

        self.sender = WeightSender()
        return self.sender.host(world, backend, timeout_s)

    def join_weight_group(self) -> None:
        self.sender.join()

    def stage_weights(self, mode: str) -> tuple[int, int] | None:
        """Gather the adapter or the full merged weights (collective) and stage them on rank 0:
        the gathered tensors are copied once, into the staging buckets."""
        import torch

        from sleuth.train.fsdp import gathered

        if mode == "adapter":
            adapter = self.lora_adapter()
            return self.sender.stage(adapter) if self.rank == 0 else None
        with torch.no_grad(), gathered(self.policy):
            return self.sender.stage(self.policy.sync_state()) if self.rank == 0 else None

    def broadcast_weights(self, token: int) -> int:
        return self.sender.broadcast(token)

    def staged_payload(self, token: int) -> tuple[str, Any]:
        return self.sender.payload(token)

    def export(self, out_dir: str) -> None:
        """Rank 0 writes the merged weights as a plain HF folder; collective."""
        from sleuth.train.fsdp import gathered

        with gathered(self.policy):
            if self.rank == 0:
                self.policy.export_merged(out_dir)

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


class TrainerGroup:
    """`world_size` TrainerRank actors driven together; the loop's trainer (and policy) for FSDP2."""

    def __init__(self, cfg: Config, world_size: int, checkpoint_dir: str | Path | None = None,
                 total_steps: int | None = None, max_tokens: int | None = None, seed: int | None = None,
                 cpus_per_worker: float = 1.0, gpus_per_worker: float = 0.0,
                 node_ids: list[str] | None = None, timeout_s: float = 600.0) -> None:
        import ray

        if world_size < 1:
            raise UserError(f"cluster.trainer_workers must be >= 1, got {world_size}")
        self.world_size = world_size
        self.checkpoint_dir = None if checkpoint_dir is None else Path(checkpoint_dir)
        self.is_lora = cfg.model.lora.enabled
        actor_cls = ray.remote(TrainerRank)
        cfg_dict = cfg.model_dump(mode="json")
        self.ranks = []
        for rank in range(world_size):
            options: dict[str, Any] = {"num_cpus": cpus_per_worker, "num_gpus": gpus_per_worker,
                                       "max_restarts": 0, "name": None}
            if node_ids is not None:
                from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

                options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_ids[rank], soft=False)
            self.ranks.append(actor_cls.options(**options).remote(
                cfg_dict, rank, world_size, total_steps if total_steps is not None else cfg.loop.iterations,
                max_tokens if max_tokens is not None else cfg.rollout.max_tokens,
                cfg.loop.seed if seed is None else seed, max(1, int(cpus_per_worker))))
        addr, port = self._all("address", ranks=[0])[0]
        self._all("setup", addr, port, timeout_s)
        self.adapter_is_portable = self.is_lora and self._all("adapter_is_portable", ranks=[0])[0]
        self.model_path = cfg.model.path
        self._tokenizer: Any = None

    @classmethod
    def from_config(cls, cfg: Config, placement: Sequence[Assignment], checkpoint_dir: Path,
                    seed: int) -> TrainerGroup:
        """The loop's trainer ranks, each on the node the placement planned for it (the plan was
        checked against the cluster's resources, so none is left pending). `cfg.model.dtype` must
        already be resolved for the machine; `seed` is what a one-process run seeds torch with
        before building its policy, so the LoRA initialisation is the same."""
        ranks = sorted((a for a in placement if a.spec.kind == "trainer"), key=lambda a: a.spec.index)
        C = cfg.cluster
        return cls(cfg, len(ranks), checkpoint_dir, seed=seed, cpus_per_worker=C.cpus_per_worker,
                   gpus_per_worker=ranks[0].spec.gpus, node_ids=[a.node.node_id for a in ranks],
                   timeout_s=C.sync_timeout_s)

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer, loaded in the driver (it never holds the weights)."""
        if self._tokenizer is None:
            from sleuth.system.models import load_tokenizer

            self._tokenizer = load_tokenizer(self.model_path)
        return self._tokenizer

    def placement_lines(self) -> list[str]:
        return [f"trainer rank {r}: pid {pid}" for r, pid in enumerate(self.pids())]

    # ------------------------------------------------------------------ the Trainer's interface

    def step(self, groups: list[Group], on_row: Any = None) -> dict[str, float]:
        """One iteration's update on every rank; rank 0's metrics (they are global sums)."""
        return self._all("step", groups)[0]

    def state_dict(self) -> dict[str, Any]:
        return self._all("state_dict", ranks=[0])[0]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._all("load_state_dict", state)

    def save(self, directory: str | Path) -> Path:
        """The sharded checkpoint (trainable weights + optimizer), each rank writing its shards."""
        self._all("save", str(directory))
        return Path(directory)

    def load_weights(self, directory: str | Path) -> None:
        """Load a checkpoint's weights written by any number of ranks or by one plain process."""
        self._all("load", str(directory))

    def greedy_probe(self, prompt_ids: list[int], n: int) -> tuple[list[int], Any]:
        """The trainer's side of the weight-sync check (rollout/sync_check.py), from rank 0."""
        return self._all("greedy_probe", prompt_ids, n)[0]

    def sync_state(self) -> Iterator[tuple[str, Any]]:
        """(HF name, tensor) of the full merged weights, gathered on rank 0."""
        yield from self._all("sync_state")[0]

    def lora_adapter(self) -> LoraAdapter:
        adapter = self._all("lora_adapter")[0]
        if adapter is None:
            raise ValueError("lora_adapter: the trainer ranks train full weights (model.lora.enabled=false)")
        return adapter

    # -- cluster/collective.py's Sender: rank 0 broadcasts to the rollout workers

    def host_weight_group(self, world: int, backend: str, timeout_s: float) -> tuple[str, int]:
        return self._all("host_weight_group", world, backend, timeout_s, ranks=[0])[0]

    def join_weight_group(self) -> None:
        self._all("join_weight_group", ranks=[0])

    def stage_weights(self, mode: str, copy: bool) -> tuple[int, int]:
        return self._all("stage_weights", mode)[0]  # staging copies: `copy` needs nothing more

    def broadcast_weights(self, token: int) -> int:
        return self._all("broadcast_weights", token, ranks=[0])[0]

    def staged_payload(self, token: int) -> tuple[str, Any]:
        return self._all("staged_payload", token, ranks=[0])[0]

    def export_merged(self, out_dir: str | Path) -> Path:
        """A plain HF model folder (rank 0 writes it; the driver and rank 0 share a filesystem)."""
        self._all("export", str(out_dir))
        return Path(out_dir)

    def pids(self) -> list[int]:
        return self._all("pid")

    def close(self) -> None:
        import ray

        for actor in self.ranks:
            ray.kill(actor)
        self.ranks = []

    # ------------------------------------------------------------------ calls and failures

    def _all(self, method: str, *args: Any, ranks: list[int] | None = None) -> list[Any]:
        """Call `method` on the given ranks (all by default), wait for all; a failure stops the group."""
        import ray

        from sleuth.cluster.collective import CollectiveError

        which = list(range(self.world_size)) if ranks is None else ranks
        refs = [getattr(self.ranks[r], method).remote(*args) for r in which]
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(done[0])
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as e:
                if isinstance(e, ray.exceptions.RayTaskError) and isinstance(e.cause, CollectiveError):
                    raise e.cause from None  # the broadcast to the rollout workers failed, not a rank
                # A dead rank leaves the others blocked in a collective; let them fail or finish for
                # a moment so that the rank that died (not one that only lost its peer) is named.
                ray.wait(pending, num_returns=len(pending), timeout=5.0)
                self._stop(which, refs, method)
        return ray.get(refs)

    def _stop(self, which: list[int], refs: list[Any], method: str) -> None:
        import ray

        dead, failed = [], []
        for rank, ref in zip(which, refs):
            ready, _ = ray.wait([ref], timeout=0)
            if not ready:
                continue
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError:
                dead.append(rank)
            except ray.exceptions.RayTaskError as e:
                failed.append((rank, str(e.cause if e.cause is not None else e).strip().splitlines()[-1]))
        self.close()
        if dead:
            what = f"trainer rank {dead[0]} died (its process exited) during {method}"
        elif failed:
            what = f"trainer rank {failed[0][0]} failed during {method}: {failed[0][1]}"
        else:
            what = f"a trainer rank stopped during {method}"
        raise TrainerRankDied(f"{what}; the run stopped: {self._resume_hint()}")

    def _resume_hint(self) -> str:
        from sleuth.run.checkpoint import CheckpointManager

        latest = None if self.checkpoint_dir is None else CheckpointManager(self.checkpoint_dir).latest()
        if latest is None:
            return "no checkpoint was saved yet, so it restarts from the beginning"
        return f"resume from checkpoint {latest.path} with `sleuth train --resume`"
