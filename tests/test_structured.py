"""Structured output (sleuth.rollout.constraints): answer patterns, the start-up checks, and vLLM sampling
only completions that match them, in training and in the held-out evaluation."""

from __future__ import annotations

import importlib.util
import itertools
import re
from dataclasses import replace

import pytest
import torch

from sleuth.cli import main
from sleuth.config import load_config
from sleuth.errors import ConfigError, DataError, UserError
from sleuth.records import Problem, SamplingParams
from sleuth.rollout.base import GenerationRequest, check_request
from sleuth.rollout.constraints import (
    TokenMasks,
    attach_token_masks,
    check_structured_output,
    constrained,
    guided_samples,
    resolve_guided_samples,
)
from sleuth.tasks.patterns import one_of, regex_literal
from sleuth.tasks.temporal_clue.grade import grade, valid_fraction
from sleuth.tasks.temporal_clue.task import TemporalClueTask

HAS_VLLM = importlib.util.find_spec("vllm") is not None

YES_NO_TASK = '''
def problems(cfg):
    for i in range(12):
        yield {"id": f"p{i}", "prompt": f"Say yes or no ({i})", "answer": "yes",
               "answer_pattern": "(yes|no)( [ab]{1,3})?", "split": "eval" if i < 2 else "train"}


def verify(answer, text):
    return 1.0 if text.startswith(answer) else 0.0
'''


def test_regex_literal_matches_exactly_the_text():
    texts = ["Mrs. White", "11:45 PM", "a+b (c)|[d]*?^$\\{e}", "Cloak Room"]
    for text in texts:
        pattern = regex_literal(text)
        assert re.fullmatch(pattern, text)
        assert " " not in text or "\\ " not in pattern  # spaces stay plain (xgrammar warns on "\ ")
    assert not re.fullmatch(regex_literal("Mrs. White"), "Mrsx White")
    group = one_of(["Mrs. White", "Knife"])
    assert [bool(re.fullmatch(group, t)) for t in ("Mrs. White", "Knife", "Mrs_ White", "Mrs. WhiteKnife")] == \
        [True, True, False, False]
    with pytest.raises(ValueError, match="no options"):
        one_of([])


@pytest.fixture(scope="module")
def tc_task():
    cfg = load_config(None, ["task.eval_size=4"]).task
    return TemporalClueTask(cfg)


def test_temporal_clue_pattern_is_the_answer_sheet(tc_task):
    for problem in [tc_task.train_problem(i) for i in range(3)] + tc_task.eval_problems():
        pattern = re.compile(tc_task.answer_pattern(problem))
        choices = problem.metadata["choices"]
        letters = list(problem.answer)
        truth = "\n".join(f"{q}. {problem.answer[q]}" for q in letters)
        assert pattern.fullmatch(truth) and grade(problem.answer, truth) == 1.0
        # Every sheet the pattern admits answers each question with one of its listed choices.
        combos = itertools.islice(itertools.product(*(choices[q] for q in letters)), 50)
        for combo in combos:
            sheet = "\n".join(f"{q}. {c}" for q, c in zip(letters, combo, strict=True))
            assert pattern.fullmatch(sheet)
            assert valid_fraction({q: choices[q] for q in letters}, sheet) == 1.0
            right = sum(c == problem.answer[q] for q, c in zip(letters, combo, strict=True)) / len(letters)
            assert grade(problem.answer, sheet) == pytest.approx(right)
        wrong_kind = truth.replace(f"A. {problem.answer['A']}", "A. Nobody")
        assert not pattern.fullmatch(wrong_kind)
        assert not pattern.fullmatch(truth + "\nextra")
    bare = Problem("x", [], {"A": "Mrs. White"}, {})
    assert tc_task.answer_pattern(bare) is None  # no listed choices: no pattern


def allowed_at(bitmask, k: int) -> list[int]:
    words = bitmask[k].tolist()
    return [32 * w + j for w, word in enumerate(words) for j in range(32) if (word >> j) & 1]


@pytest.fixture(scope="module")
def smol_tokenizer():
    from sleuth.system.models import load_tokenizer, resolve_model_path

    return load_tokenizer(str(resolve_model_path(load_config(None, []).model.path)))


def test_token_masks_replay_the_grammar(tc_task, smol_tokenizer):
    """Each step of a sheet the pattern admits: the sampled token is allowed; a label is the only
    allowed token; the first token of an answer may start any listed choice and nothing else."""
    tok = smol_tokenizer
    problem = tc_task.eval_problems()[0]
    choices = problem.metadata["choices"]
    sheet = "\n".join(f"{q}. {choices[q][-1]}" for q in problem.answer)
    ids = [*tok.encode(sheet, add_special_tokens=False), tok.eos_token_id]
    masks = TokenMasks(tok)
    bitmask, refused = masks.bitmask(tc_task.answer_pattern(problem), ids)
    assert refused == 0 and bitmask.shape == (len(ids), -(-masks.info.vocab_size // 32))
    assert bitmask.dtype == torch.int32
    for k, t in enumerate(ids):
        assert t in allowed_at(bitmask, k)
    assert allowed_at(bitmask, 0) == tok.encode("A", add_special_tokens=False)  # the first label: forced
    assert allowed_at(bitmask, len(ids) - 1) == [tok.eos_token_id]  # the sheet complete: only the end
    first = allowed_at(bitmask, 2)  # after "A", "."
    texts = [tok.decode([t]) for t in first]
    for choice in choices["A"]:  # each listed choice can start here ...
        assert any((" " + choice).startswith(x) for x in texts), choice
    for x in texts:  # ... and only a listed choice
        assert any((" " + c).startswith(x) for c in choices["A"]), x
    # A token the grammar refuses ends the replay: from there on every token is allowed.
    bad = [*ids[:2], *tok.encode(" Nobody", add_special_tokens=False)]
    bitmask, refused = masks.bitmask(tc_task.answer_pattern(problem), bad)
    assert refused == 1 and (bitmask[2:] == -1).all() and len(allowed_at(bitmask, 1)) == 1


def test_attach_token_masks_skips_unconstrained_groups(tc_task, smol_tokenizer):
    from sleuth.records import Completion, Group

    tok = smol_tokenizer
    problem = tc_task.eval_problems()[0]
    ids = tok.encode("A.", add_special_tokens=False)
    groups = [Group(problem, [1], [Completion([1], list(ids), [0.0] * len(ids), "length", "A.")]) for _ in range(2)]
    assert attach_token_masks(TokenMasks(tok), groups, [tc_task.answer_pattern(problem), None]) == 0
    assert groups[0].completions[0].token_bitmask.shape[0] == len(ids)
    assert groups[1].completions[0].token_bitmask is None


def test_constrained_sets_the_regex_only_when_on(tc_task):
    problem = tc_task.eval_problems()[0]
    base = SamplingParams(temperature=0.7, max_tokens=64, seed=3)
    assert constrained(base, tc_task, problem, enabled=False) is base
    on = constrained(base, tc_task, problem, enabled=True)
    assert on.regex == tc_task.answer_pattern(problem)
    assert (on.temperature, on.max_tokens, on.seed) == (0.7, 64, 3)
    with pytest.raises(ConfigError, match="gave no answer pattern for problem 'x'"):
        constrained(base, tc_task, Problem("x", [], {"A": "Mrs. White"}, {}), enabled=True)


def test_the_task_stop_strings_end_the_sheet_in_training_and_evaluation(tc_task):
    """task.temporal_clue.stop_after_sheet: a completion ends where a line would start the question after the
    sheet's last; `constrained` (which the sampler and the evaluation both call) adds it."""
    from sleuth.tasks.temporal_clue.task import TemporalClueTask

    problem = tc_task.eval_problems()[0]
    last = max(problem.answer)
    base = SamplingParams(temperature=0.7, max_tokens=64, stop=("</s>",))
    assert tc_task.stop_strings(problem) == [] and constrained(base, tc_task, problem, enabled=False) is base
    task = TemporalClueTask(load_config(None, ["task.temporal_clue.stop_after_sheet=true"]).task)
    stop = f"\n{chr(ord(last) + 1)}."
    assert task.stop_strings(problem) == [stop]
    assert constrained(base, task, problem, enabled=False).stop == ("</s>", stop)
    on = constrained(base, task, problem, enabled=True)
    assert on.stop == ("</s>", stop) and on.regex == task.answer_pattern(problem)
    assert task.stop_strings(Problem("x", [], {"A": "Mrs. White", "B": "Rope"}, {})) == ["\nC."]


def test_start_up_checks(tc_task, tmp_path):
    on = load_config(None, ["rollout.structured_output=true"])
    check_structured_output(on, tc_task, "vllm")
    check_structured_output(load_config(None, []), tc_task, "hf")  # off: nothing to check
    with pytest.raises(ConfigError, match=r"needs rollout\.engine=vllm"):
        check_structured_output(on, tc_task, "hf")
    from sleuth.tasks.math import MathTask

    math_file = tmp_path / "m.jsonl"
    math_file.write_text('{"problem": "1+1", "answer": 2}\n')
    math_cfg = load_config(None, ["task.name=math", f"task.train_path={math_file}", f"task.eval_path={math_file}",
                                  "rollout.structured_output=true"])
    with pytest.raises(ConfigError, match="task 'math' has no answer pattern"):
        check_structured_output(math_cfg, MathTask(math_cfg.task), "vllm")


def test_guided_samples_at_start_up(tc_task, tmp_path):
    """rollout.guided_samples is drawn on vLLM for a task with an answer pattern; elsewhere the run
    starts with a note and draws every sample freely (the embedded default sets one); leaving no
    free sample is an error."""
    from sleuth.cli.train import recipes

    assert load_config(recipes()["temporal_clue_direct"]).rollout.guided_samples == 1  # the direct-answer recipe
    guided = load_config(None, ["rollout.guided_samples=2"])
    assert guided_samples(guided, tc_task, "vllm") == (2, None)
    n, note = guided_samples(guided, tc_task, "hf")
    assert n == 0 and note == ("rollout.guided_samples=2: the hf engine has no structured outputs (rollout.engine=vllm "
                               "has), so every sample is drawn freely; set rollout.guided_samples=0 to say so")
    n, note = guided_samples(load_config(None, ["rollout.guided_samples=2", "rollout.structured_output=true"]),
                             tc_task, "vllm")
    assert n == 0 and "every sample is already constrained (rollout.structured_output)" in note
    from sleuth.tasks.math import MathTask

    math_file = tmp_path / "m.jsonl"
    math_file.write_text('{"problem": "1+1", "answer": 2}\n')
    math_cfg = load_config(None, ["task.name=math", f"task.train_path={math_file}", f"task.eval_path={math_file}",
                                  "rollout.guided_samples=2"])
    n, note = guided_samples(math_cfg, MathTask(math_cfg.task), "vllm")
    assert n == 0 and "task 'math' has no answer pattern (Task.answer_pattern)" in note
    assert resolve_guided_samples(math_cfg, MathTask(math_cfg.task), "vllm").rollout.guided_samples == 0
    assert resolve_guided_samples(guided, tc_task, "vllm") is guided
    assert guided_samples(load_config(None, ["rollout.guided_samples=0"]), tc_task, "hf") == (0, None)
    with pytest.raises(ConfigError, match=r"guided_samples=8 leaves no free sample .*samples_per_task=8"):
        guided_samples(load_config(None, ["rollout.guided_samples=8"]), tc_task, "vllm")


def test_dry_run_refuses_the_hf_engine(capsys):
    assert main(["train", "--dry-run", "task.eval_size=2", "rollout.structured_output=true",
                 "rollout.engine=hf"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "rollout.structured_output needs rollout.engine=vllm" in err[0]


@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")
def test_dry_run_says_how_many_samples_are_guided(capsys):
    assert main(["train", "temporal_clue_direct", "task.eval_size=2", "rollout.engine=vllm", "--dry-run"]) == 0
    assert "x 8 samples (1 guided), up to" in capsys.readouterr().out
    assert main(["train", "temporal_clue_direct", "task.eval_size=2", "rollout.engine=hf", "--dry-run"]) == 0
    out, err = capsys.readouterr()
    assert "x 8 samples, up to" in out and err.strip() == (
        "sleuth: note: rollout.guided_samples=1: the hf engine has no structured outputs (rollout.engine=vllm has), "
        "so every sample is drawn freely; set rollout.guided_samples=0 to say so")
    assert main(["train", "temporal_clue_direct", "task.eval_size=2", "rollout.engine=vllm", "rollout.guided_samples=3",
                 "rollout.samples_per_task=3", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "rollout.guided_samples=3 leaves no free sample" in err[0]


def test_requests_with_a_regex_are_checked():
    plain = SamplingParams(max_tokens=4, regex="(yes|no)")
    assert check_request(GenerationRequest([1, 2], 1, plain), 64, 100, structured_output=True) == 4
    with pytest.raises(UserError, match="needs the vllm engine"):
        check_request(GenerationRequest([1, 2], 1, plain, "r1"), 64, 100)
    bad = SamplingParams(max_tokens=4, regex="(yes|no")
    with pytest.raises(UserError, match="rollout request r2: regex is not a valid regular expression"):
        check_request(GenerationRequest([1, 2], 1, bad, "r2"), 64, 100, structured_output=True)


def test_user_task_answer_pattern(tmp_path):
    from sleuth.tasks.registry import build_task

    good = tmp_path / "yes_no.py"
    good.write_text(YES_NO_TASK)
    task = build_task(load_config(None, [f"task.name={good}:problems"]).task)
    assert task.answer_pattern(task.train_problem(0)) == "(yes|no)( [ab]{1,3})?"
    bad = tmp_path / "bad_pattern.py"
    bad.write_text(YES_NO_TASK.replace('"(yes|no)( [ab]{1,3})?"', "3"))
    with pytest.raises(DataError, match="'answer_pattern' must be a string"):
        build_task(load_config(None, [f"task.name={bad}:problems"]).task)


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")
def test_vllm_samples_only_matching_completions_in_training_and_evaluation(tiny_model_dir, tmp_path):
    from sleuth.eval.evaluate import eval_sampling, evaluate
    from sleuth.loop.batch import Sampler
    from sleuth.loop.train import setup
    from sleuth.run.progress import Progress
    from sleuth.train.packing import pack_groups

    task_file = tmp_path / "yes_no.py"
    task_file.write_text(YES_NO_TASK)
    cfg = load_config(None, [
        f"model.path={tiny_model_dir}", "model.dtype=float32", "model.lora.rank=4", f"task.name={task_file}:problems",
        "task.eval_size=2", "task.verifier_isolation=inline", "rollout.engine=vllm", "rollout.kv_cache_gb=0.25",
        "rollout.structured_output=true", "rollout.samples_per_task=6", "rollout.max_tokens=16",
        "rollout.temperature=1.0", "loop.tasks_per_iteration=3", "algorithm.drop_zero_advantage=false",
        "eval.temperature=1.0", "logging.tensorboard=false",
    ])
    run = setup(cfg, tmp_path / "run", resume=False)
    try:
        sampler = Sampler(run.cfg, run.policy.tokenizer, run.engine, run.verifier, run.task_for_level,
                          Progress(enabled=False))
        batch = sampler.collect(iteration=1, position=0, level=1, version=0)
        train_texts = [c.text for g in batch.groups for c in g.completions]
        # The trainer scores the constrained policy: its logprobs are the engine's (float32 both);
        # the raw model's are far lower (the random-init model puts little mass on the pattern).
        rows = pack_groups(batch.groups, 4096).rows
        with torch.no_grad():
            constrained_lp = torch.cat([run.policy.row_logprobs(r)[0] for r in rows])
            raw_lp = torch.cat([run.policy.row_logprobs(replace(r, token_bitmask=None))[0] for r in rows])
        engine_lp = torch.cat([r.engine_logprobs for r in rows])
        # A trainer step on the constrained batch: its packed self-check runs first and passes,
        # and the truncated IS weights are ~1 (the trainer's logprobs are the engine's).
        step = run.trainer.step(batch.groups)
        held_out = evaluate(run.engine, run.task, run.policy.tokenizer, run.eval_problems, 4, eval_sampling(cfg),
                            run.verifier, structured=True)
        free = evaluate(run.engine, run.task, run.policy.tokenizer, run.eval_problems, 4, eval_sampling(cfg),
                        run.verifier)
    finally:
        run.engine.close()
        run.verifier.close()
        run.writer.close()
    eval_texts = [r["text"] for r in held_out.records]
    assert len(train_texts) == 18 and len(eval_texts) == 8
    pattern = re.compile("(yes|no)( [ab]{1,3})?")
    for text in train_texts + eval_texts:
        assert pattern.fullmatch(text), text
    # Both answers occur, so groups carry a reward signal; the verifier scores them as usual.
    assert {t.split(" ")[0] for t in train_texts} == {"yes", "no"}
    assert batch.metrics["rollout/reward_mean"] == pytest.approx(
        sum(t.startswith("yes") for t in train_texts) / len(train_texts))
    assert batch.metrics["rollout/constraint_refused"] == 0
    assert step["self_check_max_diff"] < 1e-3 and abs(step["tis_weight_mean"] - 1.0) < 1e-3
    assert (constrained_lp - engine_lp).abs().max().item() < 1e-3
    assert (raw_lp - engine_lp).mean().item() < -0.5
    # Left free, the random-init byte-level model writes text outside the pattern.
    assert not all(pattern.fullmatch(r["text"]) for r in free.records)


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")
def test_vllm_guided_samples_join_free_ones_in_each_group(tiny_model_dir, tmp_path):
    """rollout.guided_samples=2 of 6: a group whose problem has an answer pattern holds four free
    completions (the random-init model leaves the pattern) and two guided ones that match it, one
    without a pattern six free ones; rollout metrics keep them apart, and the packed rows mark
    exactly the guided completions' tokens."""
    from sleuth.loop.batch import Sampler
    from sleuth.loop.train import setup
    from sleuth.run.progress import Progress
    from sleuth.train.packing import pack_groups

    task_file = tmp_path / "yes_no.py"  # odd problems have no answer pattern: their groups are all free
    task_file.write_text(YES_NO_TASK.replace('"answer_pattern": "(yes|no)( [ab]{1,3})?"',
                                             '"answer_pattern": "" if i % 2 else "(yes|no)( [ab]{1,3})?"'))
    cfg = load_config(None, [
        f"model.path={tiny_model_dir}", "model.dtype=float32", "model.lora.rank=4", f"task.name={task_file}:problems",
        "task.verifier_isolation=inline", "rollout.engine=vllm", "rollout.kv_cache_gb=0.25", "loop.evaluate=false",
        "rollout.guided_samples=2", "rollout.samples_per_task=6", "rollout.max_tokens=16", "rollout.temperature=1.0",
        "loop.tasks_per_iteration=3", "algorithm.drop_zero_advantage=false", "logging.tensorboard=false",
    ])
    run = setup(cfg, tmp_path / "run", resume=False)
    try:
        sampler = Sampler(run.cfg, run.policy.tokenizer, run.engine, run.verifier, run.task_for_level,
                          Progress(enabled=False))
        batch = sampler.collect(iteration=1, position=0, level=1, version=0)
        step = run.trainer.step(batch.groups)
    finally:
        run.engine.close()
        run.verifier.close()
        run.writer.close()
    pattern = re.compile("(yes|no)( [ab]{1,3})?")
    odd = [int(g.problem.id[1:]) % 2 for g in batch.groups]
    assert len(batch.groups) == 3 and 0 in odd and 1 in odd  # both kinds in this seed's batch
    free, guided = [], []
    for g, without_pattern in zip(batch.groups, odd, strict=True):
        n = 0 if without_pattern else 2
        assert [c.guided for c in g.completions] == [False] * (6 - n) + [True] * n
        assert all(c.token_bitmask is None for c in g.completions)  # both scored under the raw model
        free += g.completions[: 6 - n]
        guided += g.completions[6 - n:]
    assert all(pattern.fullmatch(c.text) for c in guided)
    assert not all(pattern.fullmatch(c.text) for c in free)
    free_rewards = [c.reward_info["verifier_reward"] for c in free]
    guided_rewards = [c.reward_info["verifier_reward"] for c in guided]
    assert batch.metrics["rollout/reward_mean"] == pytest.approx(sum(free_rewards) / len(free))
    assert batch.metrics["rollout/guided_reward_mean"] == pytest.approx(sum(guided_rewards) / len(guided))
    rows = pack_groups(batch.groups, 4096).rows
    marked = sum(int(r.guided.sum()) for r in rows if r.guided is not None)
    assert marked == sum(len(c.completion_ids) for c in guided) > 0
    assert step["self_check_max_diff"] < 1e-3
