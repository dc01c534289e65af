"""loop.streaming (loop/stream.py): groups generated continuously, staleness bounded per group,
in-flight weight updates in the transformers engine, nothing lost or trained twice over a kill -9.

The loop tests run the real loop with the tiny model and the transformers engine on the lowercase
task of test_loop.py.
"""

from __future__ import annotations

import asyncio
import json
import threading
from io import StringIO

import pytest
import torch

from sleuth.config import load_config
from sleuth.errors import ConfigError
from sleuth.loop.checks import check_sections
from sleuth.loop.stream import is_partial, oldest_version
from sleuth.loop.train import train
from sleuth.records import Completion, Group, Problem, SamplingParams
from sleuth.rollout.base import GenerationRequest
from sleuth.rollout.sync import WeightSync
from test_loop import kill_after_checkpoint_then_resume, overrides, read_metrics
from test_sync import assert_engine_matches, make_pair


def stream_args(tiny, task_file, iterations, staleness=2):
    return [*overrides(tiny, task_file, iterations=iterations), f"loop.max_staleness={staleness}",
            "loop.streaming=true", "algorithm.drop_zero_advantage=false", "loop.eval_every=0",
            "loop.deterministic=false"]


def test_streaming_needs_a_staleness_bound():
    cfg = load_config(None, ["loop.streaming=true"])
    with pytest.raises(ConfigError, match=r"^config key 'loop.streaming': .*max_staleness >= 1.*got 0$"):
        check_sections(cfg)
    check_sections(load_config(None, ["loop.streaming=true", "loop.max_staleness=1"]))


def _completion(versions):
    return Completion([1], [2] * len(versions or [0]), [0.0] * len(versions or [0]), "stop", "x",
                      token_versions=versions)


def test_a_groups_age_is_its_oldest_token():
    group = Group(Problem("p", [], None), [1], [_completion([3, 3, 4]), _completion(None)], version=3)
    assert oldest_version(group) == 3 and is_partial(group) == [True, False]
    # Tokens recorded older than the version the group began with (a push still landing) count.
    group = Group(Problem("p", [], None), [1], [_completion([2, 2])], version=3)
    assert oldest_version(group) == 2 and is_partial(group) == [False]


class _StaleThenFreshSampler:
    """Sampler.one_group's contract without a model: the groups of positions below `fresh_from`
    were sampled by policy version 0 (stale for a trainer at step 9), later ones by version 9."""

    def __init__(self, fresh_from: int) -> None:
        from types import SimpleNamespace

        self.fresh_from = fresh_from
        self.engine = SimpleNamespace(supports_in_flight_updates=False, in_flight_updates=False, policy_version=0)
        self.cfg = load_config(None, [])
        self.episodes = None

    def one_group(self, position, level, version, times, metrics):
        group = Group(Problem(f"p{position}", [], None), [1], [_completion(None)],
                      version=0 if position < self.fresh_from else 9)
        return group, True, None

    def _reward_metrics(self, groups, times, metrics):
        return 0.0


def test_a_take_that_only_drops_stale_groups_wakes_the_generator():
    """The buffer full of stale groups: take drops them all and must let the dispatcher refill it
    before waiting (a lost wake-up here hung a two-worker run for good)."""
    from sleuth.loop.stream import GroupStream

    cfg = load_config(None, ["loop.tasks_per_iteration=1", "loop.max_staleness=2"])
    stream = GroupStream(_StaleThenFreshSampler(fresh_from=6), cfg.loop, position=0, version=0)  # type: ignore[arg-type]
    batches = []
    taker = threading.Thread(target=lambda: batches.append(stream.take(10, 0)), daemon=True)
    taker.start()
    taker.join(60)
    try:
        assert batches, "take never returned: the generator was left asleep"
        assert batches[0].positions == [6] and batches[0].metrics["rollout/stale_dropped"] == 6
    finally:
        stream.close()


def test_streaming_run_bounds_staleness_and_accounts_for_every_position(tiny_model_dir, lowercase_task, tmp_path):
    iterations, k = 5, 2
    result = train(load_config(None, stream_args(tiny_model_dir, lowercase_task, iterations, k)), tmp_path / "run",
                   out=StringIO())
    assert result.iterations_done == iterations and result.val_after is not None
    rows = read_metrics(tmp_path / "run")[1:]
    for it, r in enumerate(rows, start=1):
        assert r["train/rows"] >= 1 and len(r["rollout/positions"]) == 2
        assert 0 <= r["rollout/staleness_mean"] <= r["rollout/staleness_max"] <= k
        assert it - 1 - r["rollout/policy_version"] <= k  # the oldest token of the batch, within the bound
        for key in ("rollout/partial_frac", "rollout/buffer_groups", "time/trainer_idle_s", "time/generator_idle_s"):
            assert r[key] >= 0, key
    assert any(r["rollout/staleness_max"] >= 1 for r in rows)  # it did train ahead of the weights
    assert any("time/sync_check_s" in r for r in rows)  # every sync checked (the check's cost logged)
    consumed = [p for r in rows for p in r["rollout/positions"] + r["rollout/skipped_positions"]]
    assert len(consumed) == len(set(consumed))
    state = json.loads((tmp_path / "run" / "checkpoints" / f"iter-{iterations:06d}" / "state.json").read_text())
    assert sorted(consumed + state["stream_pending"]) == list(range(state["data_position"]))


@pytest.mark.parametrize("lora", [True, False], ids=["adapter", "full"])
def test_hf_engine_swaps_weights_in_flight_and_records_token_versions(lora):
    """A sync (adapter-only or full weights) during a long generation lands between decoding steps
    (the generation does not finish first), the sample continues with the new weights, and its tokens
    carry both versions."""
    policy, engine = make_pair(lora=lora)
    try:
        engine.in_flight_updates = True
        request = GenerationRequest(list(range(5, 15)), n=2, request_id="long",
                                    sampling=SamplingParams(temperature=1.0, max_tokens=400, seed=1))
        started = threading.Event()
        original = engine._sample

        def sample(rows, logits):  # signals once decoding is under way
            started.set()
            return original(rows, logits)

        engine._sample = sample  # type: ignore[method-assign]
        results = []
        gen = threading.Thread(target=lambda: results.append(asyncio.run(engine.generate(request))))
        gen.start()
        assert started.wait(60)
        assert WeightSync(policy, engine).push().mode == ("adapter" if lora else "full")
        engine.policy_version = 1
        done_before_sync_returned = bool(results)
        gen.join(120)
        assert not done_before_sync_returned and results
        samples = results[0].samples
        versions = [s.token_versions for s in samples]
        assert all(v is not None and len(v) == len(s.token_ids) for v, s in zip(versions, samples))
        long = [v for v, s in zip(versions, samples) if len(s.token_ids) > 50]
        assert long and all(v[0] == 0 and v[-1] == 1 for v in long), [(v[0], v[-1]) for v in long]
        assert engine.stats()["samples"] == 2
        assert_engine_matches(policy, engine)  # the swap delivered the whole update
    finally:
        engine.close()


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("lora", [True, False], ids=["adapter", "full"])
def test_streaming_run_on_the_vllm_engine_updates_in_flight_and_checks_each_sync(tiny_model_dir, lowercase_task,
                                                                                 tmp_path, lora):
    """The in-process vLLM engine under loop.streaming: syncs (adapter-only with LoRA, else full
    weights) land between engine steps, each one checked against the trainer's probe; the bound
    holds for every trained token, every drawn position is accounted for."""
    pytest.importorskip("vllm")
    iterations, k = 4, 2
    args = [*stream_args(tiny_model_dir, lowercase_task, iterations, k), "rollout.engine=vllm",
            "rollout.kv_cache_gb=0.05", "rollout.max_tokens=24", "loop.evaluate=false", f"model.lora.enabled={lora}",
            f"rollout.native_lora={lora}"]
    train(load_config(None, args), tmp_path / "run", out=StringIO())
    rows = read_metrics(tmp_path / "run")
    assert [r["iteration"] for r in rows] == list(range(1, iterations + 1))
    assert all(r["rollout/staleness_max"] <= k and len(r["rollout/positions"]) == 2 for r in rows)
    assert all(r["sync/adapter"] == float(lora) for r in rows)
    assert any("time/sync_check_s" in r for r in rows)
    assert all(0 <= r["rollout/partial_frac"] <= 1 for r in rows)
    consumed = [p for r in rows for p in r["rollout/positions"] + r["rollout/skipped_positions"]]
    state = json.loads((tmp_path / "run" / "checkpoints" / f"iter-{iterations:06d}" / "state.json").read_text())
    assert len(consumed) == len(set(consumed))
    assert sorted(consumed + state["stream_pending"]) == list(range(state["data_position"]))


def test_weight_sync_check_stops_a_sync_that_never_arrives():
    from sleuth.rollout.sync_check import SyncCheck, WeightSyncCheckError

    for lora in (True, False):
        policy, engine = make_pair(lora=lora)
        try:
            check = SyncCheck(policy, engine, policy.tokenizer, tolerance=0.01)
            stats = WeightSync(policy, engine, check=check).push()  # delivered: the probe matches
            assert stats.check_s is not None and stats.metrics()["time/sync_check_s"] > 0
            with torch.no_grad():  # the next update, which the engine silently drops
                for p in policy.trainable_parameters():
                    p.add_(0.2 * torch.randn_like(p))
            # acknowledged, never applied (an adapter that never reaches the engine: verl #7495)
            engine.sync_lora = lambda adapter: None  # type: ignore[method-assign]
            engine.sync_weights = lambda tensors: None  # type: ignore[method-assign]
            sync = WeightSync(policy, engine, check=check)
            with pytest.raises(WeightSyncCheckError, match=r"^weight sync 1 \((adapter|full), InProcessTransport\): "
                                                           r"the engine's logprobs .* did not arrive"):
                sync.snapshot()()
        finally:
            engine.close()


@pytest.mark.slow
def test_streaming_run_killed_then_resumed_trains_each_problem_once(tiny_model_dir, lowercase_task, tmp_path):
    iterations = 6
    args = stream_args(tiny_model_dir, lowercase_task, iterations)
    killed = tmp_path / "killed"
    kill_after_checkpoint_then_resume(args, killed, 3, tmp_path)  # groups are buffered and in flight by then
    rows = read_metrics(killed)
    assert [r["iteration"] for r in rows] == list(range(iterations + 1))
    rows = rows[1:]
    trained = [p for r in rows for p in r["rollout/positions"]]
    consumed = trained + [p for r in rows for p in r["rollout/skipped_positions"]]
    assert len(trained) == 2 * iterations and len(consumed) == len(set(consumed))  # none twice
    state = json.loads((killed / "checkpoints" / f"iter-{iterations:06d}" / "state.json").read_text())
    assert sorted(consumed + state["stream_pending"]) == list(range(state["data_position"]))  # none lost


@pytest.mark.slow
def test_streaming_with_two_ray_rollout_workers_learns_bounds_staleness_and_checks_each_sync(tiny_model_dir, tmp_path):
    """1 trainer + 2 Ray rollout workers, staleness 2, weight updates in flight: the run learns the
    toy task (held-out share of lowercase letters, 16 problems x 4 samples, far above its start),
    groups spread over both workers, every sync checked on each worker (RolloutPool.probe_replicas),
    the bound holds for every trained token, every drawn position is accounted for."""
    from sleuth.testing.tasks import lowercase_task_source

    task = tmp_path / "lowercase_task.py"
    task.write_text(lowercase_task_source(400, 16))
    iterations, k = 12, 2
    args = [*stream_args(tiny_model_dir, task, iterations, k), "cluster.rollout_workers=2",
            "cluster.cpus_per_worker=0.5", "cluster.object_store_gb=0.1", "model.lora.enabled=false",
            "trainer.lr=0.01", "rollout.samples_per_task=8", "rollout.max_tokens=16", "task.eval_size=16",
            "eval.k=4", "loop.checkpoint_every=6"]
    result = train(load_config(None, args), tmp_path / "run", out=StringIO())
    before, after = result.val_before["avg"], result.val_after["avg"]
    print(f"held-out {before:.3f} -> {after:.3f}")
    assert after > before + 0.25, (before, after)  # measured in process: 0.10 -> 0.99 in 16 steps, 0.54 in 10
    rows = read_metrics(tmp_path / "run")[1:]
    assert [r["iteration"] for r in rows] == list(range(1, iterations + 1))
    assert all(r["rollout/staleness_max"] <= k and len(r["rollout/positions"]) == 2 for r in rows)
    # Every sync is checked on both workers; a check's time lands in the row of the step during which
    # its sync finished, so under load the later ones land after the last row (a failed one still
    # raises at close()): at least the first is in the metrics.
    assert sum("time/sync_check_s" in r for r in rows) >= 1
    consumed = [p for r in rows for p in r["rollout/positions"] + r["rollout/skipped_positions"]]
    state = json.loads((tmp_path / "run" / "checkpoints" / f"iter-{iterations:06d}" / "state.json").read_text())
    assert len(consumed) == len(set(consumed))
    assert sorted(consumed + state["stream_pending"]) == list(range(state["data_position"]))
