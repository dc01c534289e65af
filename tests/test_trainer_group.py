"""Two FSDP2 ranks as Ray actors behave as the single-process trainer; a killed rank stops the run
with one line naming it and the checkpoint to resume from."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import ray
import torch
from safetensors.torch import load_file

from sleuth.cli.export import export_checkpoint
from sleuth.cluster.trainer_group import TrainerGroup, TrainerRankDied
from sleuth.config import Config, load_config
from sleuth.run.checkpoint import CheckpointManager
from sleuth.testing.tiny_model import write_tiny_model
from sleuth.train.policy import Policy
from sleuth.train.sharded import is_sharded_checkpoint
from sleuth.train.step import Trainer
from test_step import random_groups

NICENESS = "RAY_worker_niceness"  # Ray's spelling (ray_constants.RAY_WORKER_NICENESS)


def make_config(tiny: Path) -> Config:
    return load_config(None, [
        f"model.path={tiny}", "model.dtype=float32", "model.lora.rank=4", "model.lora.alpha=8",
        "trainer.lr=0.01", "trainer.row_tokens=40", "rollout.max_tokens=8", "loop.iterations=3",
        "loop.seed=5",
    ])


def single_process(cfg: Config) -> tuple[Policy, Trainer]:
    torch.manual_seed(cfg.loop.seed)  # the seed every rank uses before building its policy
    policy = Policy.from_config(cfg.model, need_reference=False, device="cpu")
    return policy, Trainer(policy, cfg.algorithm, cfg.trainer, total_steps=cfg.loop.iterations,
                           max_tokens=cfg.rollout.max_tokens)


@pytest.fixture(scope="module")
def local_ray():
    # Ray runs its workers at nice 15: on a machine busy with other work they would starve.
    previous = os.environ.get(NICENESS)
    os.environ[NICENESS] = "0"
    for attempt in (1, 2):  # Ray gives its raylet 30 s to register: a saturated machine can miss that
        try:
            ray.init(address="local", num_cpus=2, object_store_memory=100 * 1024**2,
                     include_dashboard=False, log_to_driver=False)
            break
        except Exception as e:
            ray.shutdown()
            if attempt == 2 or "timed out during startup" not in str(e):
                raise
    yield
    ray.shutdown()
    if previous is None:
        del os.environ[NICENESS]
    else:
        os.environ[NICENESS] = previous


@pytest.mark.slow
def test_group_steps_checkpoints_and_reports_a_dead_rank(local_ray, tmp_path: Path) -> None:
    cfg = make_config(write_tiny_model(tmp_path / "tiny", hidden=32))
    groups = random_groups(21, n_groups=1, n_comp=6) + random_groups(22, n_groups=3, n_comp=2)
    group = TrainerGroup(cfg, world_size=2, checkpoint_dir=tmp_path / "run" / "checkpoints")
    try:
        policy, trainer = single_process(cfg)
        got, want = group.step(groups), trainer.step(groups)
        for key in ("loss", "grad_norm", "entropy"):
            assert got[key] == pytest.approx(want[key], rel=1e-5), key
        synced = dict(group.sync_state())
        for name, t in policy.sync_state():
            torch.testing.assert_close(synced[name], t, rtol=1e-5, atol=1e-6)
        adapter, want_adapter = group.lora_adapter(), policy.lora_adapter()
        assert adapter.rank == 4 and set(adapter.tensors) == set(want_adapter.tensors)
        for name, t in want_adapter.tensors.items():  # whole plain tensors, not the ranks' shards
            assert type(adapter.tensors[name]) is torch.Tensor and adapter.tensors[name].shape == t.shape
            torch.testing.assert_close(adapter.tensors[name], t, rtol=1e-5, atol=1e-6)

        # A checkpoint through the run's CheckpointManager, resumed by one plain process.
        checkpoints = CheckpointManager(tmp_path / "run" / "checkpoints")
        saved = checkpoints.save(1, group, group, {"data_position": 8})
        assert is_sharded_checkpoint(saved / "policy")
        resumed, resumed_trainer = single_process(cfg)
        checkpoints.restore(checkpoints.latest(), resumed, resumed_trainer, restore_rng=False)
        assert resumed_trainer.step_count == 1
        for name, t in resumed.sync_state():
            torch.testing.assert_close(synced[name], t, rtol=0, atol=0)
        # `sleuth export` of the sharded checkpoint: one plain HF folder with the merged weights.
        exported = export_checkpoint(tmp_path / "run", "latest", tmp_path / "export", cfg=cfg)
        files = load_file(str(exported / "model.safetensors"))
        assert set(files) == set(synced)
        for name, t in files.items():
            torch.testing.assert_close(t, synced[name], rtol=0, atol=0)
        # The next step from the resumed process equals the next step of the uninterrupted one.
        assert resumed_trainer.step(groups)["loss"] == pytest.approx(trainer.step(groups)["loss"], rel=1e-6)

        os.kill(group.pids()[1], signal.SIGKILL)
        with pytest.raises(TrainerRankDied) as err:
            group.step(groups)
        message = str(err.value)
        assert "\n" not in message
        assert "trainer rank 1 died" in message and str(saved) in message
    finally:
        group.close()


@pytest.mark.slow
def test_rank0_broadcasts_full_weights_to_a_rollout_worker(local_ray, tmp_path: Path) -> None:
    """cluster.weight_transport=collective with FSDP2 ranks (full fine-tuning): rank 0 gathers the
    weights and broadcasts them (gloo) to a rollout worker, which then generates what an engine
    holding the same weights in this process generates, and no longer what it generated before."""
    from sleuth.cluster.collective import CollectiveTransport
    from sleuth.cluster.rollout_pool import RolloutPool
    from sleuth.cluster.runtime import WorkerSpec
    from sleuth.cluster_config import ClusterConfig
    from sleuth.config import RolloutConfig
    from sleuth.records import SamplingParams
    from sleuth.rollout.base import GenerationRequest
    from sleuth.rollout.factory import make_engine
    from sleuth.rollout.sync import InProcessTransport, WeightSync

    tiny = write_tiny_model(tmp_path / "tiny", hidden=32)
    cfg = load_config(None, [f"model.path={tiny}", "model.dtype=float32", "model.lora.enabled=false",
                             "trainer.lr=0.05", "trainer.row_tokens=40", "rollout.max_tokens=8", "loop.seed=5"])
    rollout = RolloutConfig(engine="hf", max_tokens=8)
    group = TrainerGroup(cfg, world_size=2, cpus_per_worker=0.5)
    pool = RolloutPool(rollout, ClusterConfig(), str(tiny), "float32", 0, [WorkerSpec("rollout", 0, 0.5, 0)])
    local = make_engine(rollout, str(tiny), "float32", 0)
    reqs = [GenerationRequest([5 + j] * 4, n=4, request_id=f"r{j}", sampling=SamplingParams(max_tokens=8, seed=j))
            for j in range(4)]

    def tokens(engine) -> list:
        return [[s.token_ids for s in r.samples] for r in engine.generate_all(reqs)]

    try:
        before = tokens(pool)
        group.step(random_groups(23, n_groups=2, n_comp=3))  # the weights move off the folder's
        transport = CollectiveTransport(pool, group, "gloo", 60)
        transport.connect()
        stats = WeightSync(group, pool, transport).push()
        assert stats.mode == "full"
        assert transport._restarts_seen == pool.restarts and pool.stats()["broadcast_fallbacks"] == 0
        moved = InProcessTransport().send_full(local, group.sync_state())
        assert stats.bytes >= moved > 0
        after = tokens(pool)
        assert after == tokens(local)
        assert after != before
    finally:
        pool.close()
        local.close()
        group.close()
