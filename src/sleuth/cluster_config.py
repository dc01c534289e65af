"""The `cluster:` section: where the stages run (one process, or Ray workers). Kept beside
config.py, like task_config.py, because config imports no stage and sleuth.cluster imports Ray's
side of things; sleuth.cluster.runtime reads it."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from sleuth.section import Section


class ClusterConfig(Section):
    """Where the stages run. With both worker counts at 1 and no address the whole run stays in this
    process and Ray is never imported; anything else starts (or joins) a Ray cluster."""

    trainer_workers: int = Field(1, ge=1)
    """FSDP2 trainer ranks, each a Ray actor (1: the trainer runs in the driver process)."""
    rollout_workers: int = Field(1, ge=1)
    """Rollout engine replicas, each a Ray actor owning one engine; groups go to the least-loaded one."""
    address: str | None = None
    """A Ray cluster to join: "auto" (the one `ray start` made on this machine) or "HOST:PORT" of its
    head node. None: start a local Ray cluster when workers are asked for, else no Ray at all."""
    cpus_per_worker: float = Field(1.0, gt=0)
    """Ray CPUs reserved per trainer or rollout actor (fractions allowed, e.g. 0.5 to fit 4 workers on
    a 2-core machine); the actor's torch uses round(this) threads, at least 1."""
    gpus_per_trainer_worker: float | None = Field(None, ge=0)
    """GPUs per trainer rank; None: 1 when the cluster has GPUs, else 0."""
    gpus_per_rollout_worker: int | None = Field(None, ge=0)
    """GPUs per rollout worker (the vLLM tensor-parallel size); None: 1 when the cluster has GPUs, else 0."""
    object_store_gb: float | None = Field(None, gt=0)
    """Object store size of a local cluster that sleuth starts (weights travel through it on CPU);
    None: Ray's default (30% of RAM). Ignored when joining an address."""
    connect_timeout_s: float = Field(30.0, gt=0)
    """Starting or joining the cluster and starting the workers must finish within this."""
    sync_timeout_s: float = Field(600.0, gt=0)
    """One weight sync from the trainer to every rollout worker must finish within this, else the run
    stops with WeightSyncTimeoutError naming the worker."""
    weight_transport: Literal["auto", "object_store", "collective"] = "auto"
    """How weights reach the rollout workers: "object_store" (byte buckets through Ray's object
    store, read by each worker), "collective" (a torch.distributed broadcast from the process that
    holds the weights, the driver or trainer rank 0: NCCL between GPUs, gloo on CPU), "auto"
    (collective when the trainer and the rollout workers are on GPUs, else object_store)."""

    @field_validator("address")
    @classmethod
    def _address_form(cls, value: str | None) -> str | None:
        if value is None or value == "auto":
            return value
        host, sep, port = value.removeprefix("ray://").rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError("must be 'auto' or HOST:PORT (e.g. 10.0.0.1:6379)")
        return value

    @property
    def uses_ray(self) -> bool:
        return self.trainer_workers > 1 or self.rollout_workers > 1 or self.address is not None
