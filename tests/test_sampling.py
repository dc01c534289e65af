"""Building a training batch: DAPO dynamic sampling, the over-length penalty, truncation masking.

A user task alternates two kinds of problem: "flat" ones whose verifier gives every completion the
same reward (zero advantage, no gradient) and "varied" ones that reward the fraction of lowercase
letters (a random-init model's completions differ on it). The real transformers engine samples.
"""

from pathlib import Path

import pytest

from sleuth.config import load_config
from sleuth.loop.batch import Sampler, mask_truncated, overlong_penalty
from sleuth.loop.train import setup
from sleuth.records import Completion, Group, Problem
from sleuth.run.progress import Progress
from sleuth.testing.tiny_model import write_tiny_model

TASK_SOURCE = '''
def problems(cfg):
    for i in range(40):
        yield {"id": f"p{i}", "prompt": f"Write lowercase letters ({i})",
               "answer": "flat" if i % 2 else "varied", "split": "eval" if i < 2 else "train"}


def verify(answer, text):
    if answer == "flat":
        return 0.5
    return sum("a" <= c <= "z" for c in text) / len(text) if text else 0.0
'''


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("sampling")
    (root / "mixed_task.py").write_text(TASK_SOURCE)
    return write_tiny_model(root / "tiny"), root / "mixed_task.py"


def make_sampler(files, tmp_path: Path, *extra: str):
    tiny, task_file = files
    cfg = load_config(None, [
        f"model.path={tiny}", "model.dtype=float32", "model.lora.rank=4", f"task.name={task_file}:problems",
        "task.verifier_isolation=inline", "rollout.engine=hf", "rollout.samples_per_task=4",
        "rollout.max_tokens=6", "loop.tasks_per_iteration=3", "loop.evaluate=false",
        "logging.tensorboard=false", *extra])
    run = setup(cfg, tmp_path / "run", resume=False)
    sampler = Sampler(run.cfg, run.policy.tokenizer, run.engine, run.verifier, run.task_for_level, Progress(enabled=False))
    return run, sampler


def kinds(run, positions):
    return [run.task.train_problem(p).answer for p in positions]


def test_dynamic_sampling_draws_until_the_batch_is_full(files, tmp_path):
    run, sampler = make_sampler(files, tmp_path, "algorithm.dynamic_sampling=true", "algorithm.max_sampling_rounds=4")
    try:
        batch = sampler.collect(iteration=1, position=5, level=1, version=0)
        drawn = list(range(5, batch.end))
        varied = [p for p in drawn if run.task.train_problem(p).answer == "varied"]
        # Each round draws exactly the groups still missing, so the draws stop once three varied
        # problems were seen (or after 4 rounds): nothing is drawn and left unseen.
        assert len(batch.groups) == 3 and batch.positions == varied
        assert kinds(run, batch.positions) == ["varied"] * 3
        assert batch.metrics["rollout/sampling_draws"] == len(drawn)
        assert batch.metrics["rollout/sampling_drops"] == len(drawn) - 3
        assert batch.metrics["rollout/sampling_rounds"] >= 2
        assert all(any(abs(a) > 0 for a in g.advantages) for g in batch.groups)
        # The batch starts where it was told and the next one where its draws ended.
        again = sampler.collect(iteration=2, position=batch.end, level=1, version=1)
        assert again.start == batch.end and again.metrics["rollout/policy_version"] == 1
    finally:
        run.engine.close()


def test_one_round_without_dynamic_sampling_and_truncated_completions_masked(files, tmp_path):
    run, sampler = make_sampler(files, tmp_path, "algorithm.mask_truncated=true")
    try:
        batch = sampler.collect(iteration=1, position=0, level=1, version=0)
        assert batch.end == 3 and batch.metrics["rollout/sampling_rounds"] == 1
        dropped = batch.metrics["train/groups_dropped"]
        assert len(batch.groups) + dropped == 3 and dropped >= kinds(run, range(3)).count("flat")
        assert kinds(run, batch.positions) == ["varied"] * len(batch.groups)
        assert batch.metrics["rollout/overlong_penalty"] == 0.0
        assert batch.metrics["rollout/truncated_frac"] > 0  # some were cut at max_tokens ...
        assert all(c.finish_reason != "length" for g in batch.groups for c in g.completions)  # ... and masked
    finally:
        run.engine.close()


def test_overlong_penalty_is_its_own_reward_term(files, tmp_path):
    # max_tokens 6, buffer 4: a completion of 6 tokens (cut at the limit) loses 0.8 * (6 - 2) / 4.
    run, sampler = make_sampler(files, tmp_path, "algorithm.overlong_buffer=4", "algorithm.overlong_penalty=0.8",
                                "algorithm.drop_zero_advantage=false")
    try:
        batch = sampler.collect(iteration=1, position=0, level=1, version=0)
        comps = [c for g in batch.groups for c in g.completions]
        for c in comps:
            expected = -0.8 * max(0, min(len(c.completion_ids) - 2, 4)) / 4
            assert c.reward_info["overlong_penalty"] == pytest.approx(expected)
            assert c.reward == pytest.approx(c.reward_info["verifier_reward"] + expected)
        assert any(c.reward_info["overlong_penalty"] < 0 for c in comps)
        mean_penalty = sum(c.reward_info["overlong_penalty"] for c in comps) / len(comps)
        assert batch.metrics["rollout/overlong_penalty"] == pytest.approx(mean_penalty)
        # The logged rollout reward is the verifier's, before shaping.
        assert batch.reward_mean == pytest.approx(sum(c.reward_info["verifier_reward"] for c in comps) / len(comps))
    finally:
        run.engine.close()


def test_overlong_penalty_formula():
    assert overlong_penalty(10, 100, 0, 1.0) == 0.0  # off
    assert overlong_penalty(80, 100, 20, 1.0) == 0.0
    assert overlong_penalty(90, 100, 20, 1.0) == pytest.approx(-0.5)
    assert overlong_penalty(100, 100, 20, 2.0) == pytest.approx(-2.0)
    assert overlong_penalty(130, 100, 20, 1.0) == pytest.approx(-1.0)  # capped at the limit


def test_mask_truncated_keeps_the_baseline_but_drops_the_loss():
    def comp(reason):
        return Completion([1], [2, 3], [-0.1, -0.2], reason, "x")

    g = Group(Problem("p", [], None), [1], [comp("stop"), comp("length"), comp("stop")], advantages=[1.0, -2.0, 1.0])
    out = mask_truncated(g)
    assert [c.finish_reason for c in out.completions] == ["stop", "stop"]
    assert out.advantages == [1.0, 1.0]  # computed with the truncated one in the group
    assert len(g.completions) == 3  # the input is not modified


class _FormatTask:
    """Stands in for a task with a format score: the fraction of a completion's letters that are 'a'."""

    def format_score(self, problem, completion):
        return completion.count("a") / len(completion) if completion else 0.0


def test_format_reward_is_its_own_reward_term_and_breaks_ties():
    cfg = load_config(None, ["algorithm.format_reward=0.5", "algorithm.advantage=grpo"])
    sampler = Sampler(cfg, None, None, None, None, Progress(enabled=False))
    problem = Problem("p", [{"role": "user", "content": "x"}], "answer", {})

    def group(texts):
        comps = [Completion([1], [2, 3], [0.0, 0.0], "stop", t, reward=0.0) for t in texts]
        return Group(problem, [1], comps)

    tied = group(["aaaa", "abab", "bbbb", "aabb"])  # equally wrong, different formats
    flat = group(["ab", "ab", "ab", "ab"])          # equally wrong, same format: still no signal
    metrics = {}
    kept, positions = sampler._advantages(_FormatTask(), [tied, flat], [7, 8], metrics)
    assert positions == [7] and len(kept) == 1
    comps = kept[0].completions
    assert [c.reward_info["format_reward"] for c in comps] == pytest.approx([0.5, 0.25, 0.0, 0.25])
    assert [c.reward for c in comps] == pytest.approx([0.5, 0.25, 0.0, 0.25])
    assert all(c.reward_info["verifier_reward"] == 0.0 for c in comps)
    adv = kept[0].advantages
    assert adv[0] > adv[1] > adv[2] and adv[1] == pytest.approx(adv[3])
    out = {}
    mean = sampler._reward_metrics([tied, flat], {"rollout": 1.0, "score": 0.0, "errors": 0, "timeouts": 0}, out)
    assert mean == 0.0 and out["rollout/reward_mean"] == 0.0  # the verifier's reward, before shaping
    assert out["rollout/format_reward"] == pytest.approx((1.0 + 4 * 0.25) / 8)


def test_format_reward_on_a_task_without_a_format_score_is_a_note(files):
    from sleuth.loop.batch import check_format_reward
    from sleuth.tasks.registry import build_task

    _, task_file = files
    cfg = load_config(None, [f"task.name={task_file}:problems", "algorithm.format_reward=0.3"])
    note = check_format_reward(cfg, build_task(cfg.task))
    assert note is not None and "has no format score" in note and "no format term is added" in note
    assert check_format_reward(load_config(None, ["algorithm.format_reward=0.3"]),
                               build_task(load_config(None, []).task)) is None  # Temporal Clue has one
