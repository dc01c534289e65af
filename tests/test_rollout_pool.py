"""cluster/rollout_pool.py: two real Ray rollout workers (transformers engine, tiny model) against the
in-process engine: the same samples, weight and LoRA syncs through the object store, a worker
killed with SIGKILL mid-stream, and the sync timeout."""

import asyncio
import os
import signal

import pytest
import torch

from sleuth.cluster.rollout_pool import RolloutPool, WeightSyncTimeoutError
from sleuth.cluster.runtime import WorkerSpec, connect
from sleuth.cluster_config import ClusterConfig
from sleuth.config import RolloutConfig
from sleuth.records import LoraAdapter, SamplingParams
from sleuth.rollout.base import GenerationRequest
from sleuth.rollout.factory import make_engine
from sleuth.rollout.sync import RayTransport
from sleuth.testing.tiny_model import write_tiny_model

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def cluster():
    cluster = connect(ClusterConfig(rollout_workers=2, object_store_gb=0.1))  # a local cluster
    yield cluster
    cluster.shutdown()


@pytest.fixture(scope="module")
def pool_and_local(tiny, cluster):
    rollout = RolloutConfig(engine="hf", max_tokens=24)
    specs = [WorkerSpec("rollout", i, 0.5, 0) for i in range(2)]
    pool = RolloutPool(rollout, ClusterConfig(rollout_workers=2), str(tiny), "float32", 0, specs)
    local = make_engine(rollout, str(tiny), "float32", 0)
    yield pool, local
    pool.close()
    local.close()


def requests(count: int = 6) -> list[GenerationRequest]:
    # prompts of different lengths (padding) and a stop string (rows finish at different steps)
    return [GenerationRequest([5 + j] * (3 + 2 * j), n=4, request_id=f"r{j}",
                              sampling=SamplingParams(max_tokens=24, seed=100 + j, stop=("e",) if j % 2 else ()))
            for j in range(count)]


def assert_same(got, want):
    assert [r.request.request_id for r in got] == [r.request.request_id for r in want]
    for a, b in zip(got, want):
        assert [s.token_ids for s in a.samples] == [s.token_ids for s in b.samples]
        for x, y in zip(a.samples, b.samples):
            assert x.finish_reason == y.finish_reason
            assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5, rtol=0)


def test_groups_give_the_same_samples_as_in_process(pool_and_local):
    pool, local = pool_and_local
    reqs = requests()
    got = pool.generate_all(reqs)
    assert_same(got, local.generate_all(reqs))
    # the groups were spread over both workers (least loaded first: alternating)
    shares = pool._assign(reqs)
    assert {i: [r.request_id for r in s] for i, s in shares.items()} == {0: ["r0", "r2", "r4"],
                                                                         1: ["r1", "r3", "r5"]}
    for i, s in shares.items():
        pool._load[i] -= sum(r.n for r in s)


def test_weight_and_lora_sync_through_the_object_store(pool_and_local):
    pool, local = pool_and_local
    gen = torch.Generator().manual_seed(0)
    new = [(n, p.detach() + 0.05 * torch.randn(p.shape, generator=gen)) for n, p in local.model.named_parameters()]
    moved = RayTransport().send_full(pool, new)  # what sleuth.rollout.sync.WeightSync calls
    local.sync_weights(new)
    assert moved == sum(t.numel() * 4 for _, t in new)
    reqs = requests()
    assert_same(pool.generate_all(reqs), local.generate_all(reqs))

    tensors = {}
    for name, mod in local.model.named_modules():
        if name.endswith(("q_proj", "v_proj")):
            tensors[f"{name}.lora_A.weight"] = torch.randn(2, mod.in_features, generator=gen)
            tensors[f"{name}.lora_B.weight"] = torch.randn(mod.out_features, 2, generator=gen) * 0.1
    adapter = LoraAdapter(tensors, rank=2, alpha=4.0)
    assert pool.native_lora  # the transformers engine applies adapters itself
    assert RayTransport().send_adapter(pool, adapter) == sum(t.numel() * 4 for t in tensors.values())
    local.sync_lora(adapter)
    assert_same(pool.generate_all(reqs), local.generate_all(reqs))


def test_killed_worker_is_restarted_resynced_and_its_groups_reissued(pool_and_local):
    pool, local = pool_and_local
    # weights differ from the model folder's, so a restarted worker that missed the re-sync would differ
    gen = torch.Generator().manual_seed(1)
    new = [(n, p.detach() + 0.05 * torch.randn(p.shape, generator=gen)) for n, p in local.model.named_parameters()]
    pool.sync_weights(new)
    local.sync_weights(new)
    reqs = requests(8)
    want = {r.request.request_id: r for r in local.generate_all(reqs)}
    restarts = pool.stats()["worker_restarts"]
    victim = pool.worker_pids()[1]
    # worker 1 is frozen before the stream starts, so when the first group comes back (from worker 0)
    # worker 1 certainly still has all its groups in flight; without this a fast worker 1 could
    # finish its whole share before the kill and the test would see no restart
    os.kill(victim, signal.SIGSTOP)

    async def run():
        out = []
        async for result in pool.stream(reqs):
            if not out:
                os.kill(victim, signal.SIGKILL)
            out.append(result)
        return out

    got = asyncio.run(run())
    assert sorted(r.request.request_id for r in got) == sorted(want)  # no group lost, none twice
    assert_same(sorted(got, key=lambda r: r.request.request_id), [want[k] for k in sorted(want)])
    assert pool.stats()["worker_restarts"] == restarts + 1
    assert pool.worker_pids()[1] != victim


def test_sync_timeout_names_the_workers(pool_and_local):
    pool, local = pool_and_local
    new = [(n, p.detach().clone()) for n, p in local.model.named_parameters()]
    pool.sync_timeout_s = 1e-4
    try:
        with pytest.raises(WeightSyncTimeoutError, match=r"rollout worker\(s\) 0, 1 did not finish within "
                                                          r"0.0001 s \(cluster.sync_timeout_s\)"):
            pool.sync_weights(new)
    finally:
        pool.sync_timeout_s = 600
    pool.sync_weights(new)  # and the pool goes on
    local.sync_weights(new)
    reqs = requests(2)
    assert_same(pool.generate_all(reqs), local.generate_all(reqs))

