"""cluster/collective.py: weights broadcast over a torch.distributed group (gloo here, NCCL on GPUs).

In one process with threads: the wire format carries full weights (any dtype) and adapters bit for
bit, and a broadcast sends the staging it names. With real Ray rollout workers: a sync through the
group leaves every worker generating what an in-process engine with the same weights generates,
a worker killed between syncs is restarted, gets the weights through the object store, and the
group is built again for the next broadcast."""

from __future__ import annotations

import os
import signal
import threading

import pytest
import torch

from sleuth.cluster.collective import (
    Channel,
    CollectiveTransport,
    LocalSender,
    WeightSender,
    choose_backend,
    received,
)
from sleuth.records import LoraAdapter


def test_choose_backend() -> None:
    assert choose_backend("auto", True, True) == "nccl"
    assert choose_backend("auto", False, False) is None  # CPU: the object store
    assert choose_backend("auto", True, False) is None
    assert choose_backend("collective", False, False) == "gloo"
    assert choose_backend("collective", True, True) == "nccl"
    assert choose_backend("object_store", True, True) is None


def group_of(world: int) -> tuple[WeightSender, list[Channel]]:
    """A sender and world - 1 receivers in threads of this process, joined."""
    sender = WeightSender()
    address = sender.host(world, "gloo", 30)
    receivers = [Channel("gloo") for _ in range(world - 1)]
    threads = [threading.Thread(target=c.join, args=(r + 1, world, 30, address)) for r, c in enumerate(receivers)]
    for t in threads:
        t.start()
    sender.join()
    for t in threads:
        t.join()
    return sender, receivers


def broadcast(sender: WeightSender, receivers: list[Channel], token: int) -> list:
    out: list = [None] * len(receivers)

    def receive(i: int) -> None:
        out[i] = received(*receivers[i].receive())

    threads = [threading.Thread(target=receive, args=(i,)) for i in range(len(receivers))]
    for t in threads:
        t.start()
    moved = sender.broadcast(token)
    for t in threads:
        t.join()
    assert moved > 0
    return out


def test_full_weights_and_adapters_arrive_bit_for_bit_and_each_broadcast_sends_its_own_staging() -> None:
    gen = torch.Generator().manual_seed(0)
    full = [("a.weight", torch.randn(3, 5, generator=gen)),
            ("b.weight", torch.randn(7, generator=gen).to(torch.bfloat16)),
            ("c.ids", torch.arange(6, dtype=torch.int64).reshape(2, 3)),
            ("d.empty", torch.zeros(0, 4))]
    want = [(n, t.clone()) for n, t in full]
    sender, receivers = group_of(3)
    first, nbytes = sender.stage(full)
    assert nbytes >= sum(t.numel() * t.element_size() for _, t in full)
    changed = [(n, t + 1) for n, t in full]
    second, _ = sender.stage(changed)  # staged before the first went out (overlapped rollouts)
    with torch.no_grad():
        full[0][1].mul_(0)  # the trainer changes its tensors: the staged copy must not change
    for got in broadcast(sender, receivers, first):
        assert [n for n, _ in got] == ["a.weight", "b.weight", "c.ids", "d.empty"]
        for (_, a), (_, b) in zip(got, want):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    for got in broadcast(sender, receivers, second):
        for (_, a), (_, b) in zip(got, changed):
            assert torch.equal(a, b)

    tensors = {"m.q_proj.lora_A.weight": torch.randn(2, 8, generator=gen),
               "m.q_proj.lora_B.weight": torch.randn(8, 2, generator=gen)}
    token, _ = sender.stage(LoraAdapter(tensors, rank=2, alpha=4.0, target_modules=("q_proj",)))
    for got in broadcast(sender, receivers, token):
        assert isinstance(got, LoraAdapter)
        assert (got.rank, got.alpha, got.target_modules) == (2, 4.0, ("q_proj",))
        assert got.tensors.keys() == tensors.keys()
        assert all(torch.equal(got.tensors[k], v) for k, v in tensors.items())


# ---------------------------------------------------------------- with Ray rollout workers

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def pool_policy_local(tiny_model_dir):
    from sleuth.cluster.rollout_pool import RolloutPool
    from sleuth.cluster.runtime import WorkerSpec, connect
    from sleuth.cluster_config import ClusterConfig
    from sleuth.config import LoraConfig, ModelConfig, RolloutConfig
    from sleuth.rollout.factory import make_engine
    from sleuth.train.policy import Policy

    cluster = connect(ClusterConfig(rollout_workers=2, object_store_gb=0.1))
    rollout = RolloutConfig(engine="hf", max_tokens=16)
    specs = [WorkerSpec("rollout", i, 0.5, 0) for i in range(2)]
    pool = RolloutPool(rollout, ClusterConfig(rollout_workers=2, sync_timeout_s=60), str(tiny_model_dir),
                       "float32", 0, specs)
    local = make_engine(rollout, str(tiny_model_dir), "float32", 0)
    model_cfg = ModelConfig(path=str(tiny_model_dir), dtype="float32", lora=LoraConfig(enabled=True, rank=4, alpha=8))
    policy = Policy.from_config(model_cfg, need_reference=False)
    yield pool, policy, local
    pool.close()
    local.close()
    cluster.shutdown()


def requests(count: int = 4) -> list:
    from sleuth.records import SamplingParams
    from sleuth.rollout.base import GenerationRequest

    return [GenerationRequest([5 + j] * (3 + j), n=3, request_id=f"r{j}", sampling=SamplingParams(max_tokens=16, seed=7 + j))
            for j in range(count)]


def assert_same_samples(pool, local) -> None:
    reqs = requests()
    for a, b in zip(pool.generate_all(reqs), local.generate_all(reqs)):
        assert [s.token_ids for s in a.samples] == [s.token_ids for s in b.samples]


def move(policy, seed: int) -> None:
    """A training step's worth of change: LoRA B (zero at init) and A move."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.trainable_parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen))


@pytest.mark.slow
def test_syncs_through_the_group_match_in_process_and_survive_a_killed_worker(pool_policy_local) -> None:
    from sleuth.rollout.sync import InProcessTransport, WeightSync

    pool, policy, local = pool_policy_local
    transport = CollectiveTransport(pool, LocalSender(policy), "gloo", 60)
    transport.connect()
    for mode in ("adapter", "full"):
        move(policy, seed=1 if mode == "adapter" else 2)
        stats = WeightSync(policy, pool, transport, mode=mode).push()
        WeightSync(policy, local, InProcessTransport(), mode=mode).push()
        tensors = policy.lora_adapter().tensors.values() if mode == "adapter" else [t for _, t in policy.sync_state()]
        assert stats.bytes >= sum(t.numel() * t.element_size() for t in tensors) > 0
        assert transport._restarts_seen == pool.restarts  # sent over the group, not the fallback
        assert_same_samples(pool, local)

    # a worker dies between two syncs: the broadcast to it fails, the pool restarts it and hands it
    # the staged weights through the object store; the next sync rebuilds the group
    restarts = pool.restarts
    victim = pool.worker_pids()[1]
    os.kill(victim, signal.SIGKILL)
    for seed in (3, 4):
        move(policy, seed)
        WeightSync(policy, pool, transport, mode="full").push()
        WeightSync(policy, local, InProcessTransport(), mode="full").push()
        assert_same_samples(pool, local)
    assert pool.restarts == restarts + 1 and pool.worker_pids()[1] != victim
    assert transport._restarts_seen == pool.restarts  # the second of them went over the rebuilt group
