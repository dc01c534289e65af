"""Per-answer credit (credit.py): each answer's tokens take the advantage of that answer's
own reward within its group; everything else keeps the completion's advantage. And
algorithm.loss_on=answers: only the answers' value tokens carry loss."""

from __future__ import annotations

import pytest

from sleuth.cli import main
from sleuth.config import load_config
from sleuth.errors import ConfigError, UserError
from sleuth.records import AnswerPart, Completion, Group, Problem
from sleuth.rewards.advantages import compute_advantages, grpo, rloo
from sleuth.rewards.credit import (
    assign_answer_credit,
    check_credit,
    has_signal,
    mask_to_answers,
    token_char_ends,
    token_parts,
)
from sleuth.system.models import load_tokenizer
from sleuth.tasks.temporal_clue.task import TemporalClueTask
from sleuth.train.packing import pack_groups

SOLUTION = {"A": "Mrs. White", "B": "Knife", "C": "Library"}
SHEETS = [
    "A. Mrs. White\nB. Knife\nC. Ballroom",   # A, B right
    "A. Miss Scarlet\nB. Knife\nC. Library",  # B, C right
    "A. Mrs. White\nB. Wrench\nC. Library",   # A, C right
    "Let me think.\nA. Mrs. White\nB. Rope",  # A right, C unanswered
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(str(tiny_model_dir))


@pytest.fixture(scope="module")
def task():
    return TemporalClueTask(load_config(None, []).task)


def group_of(tokenizer, texts: list[str]) -> Group:
    problem = Problem("p", [], dict(SOLUTION), {})
    comps = []
    for t in texts:
        ids = [*tokenizer.encode(t, add_special_tokens=False), tokenizer.eos_token_id]
        comps.append(Completion([1, 2, 3], ids, [-1.0] * len(ids), "stop", t))
    return Group(problem, [1, 2, 3], comps)


def test_token_spans_follow_the_decoded_text(tokenizer):
    text = "A. Mrs. White\nB. Knife"
    ids = [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]
    ends = token_char_ends(tokenizer, ids)
    assert ends[-1] == ends[-2] == len(text)  # EOS adds no characters
    parts = [AnswerPart("A", 0, 13, 1.0), AnswerPart("B", 14, 22, 0.0)]
    owner = token_parts(parts, ends)
    begins = [0, *ends[:-1]]
    for k, j in enumerate(owner):
        if j >= 0:
            assert parts[j].start <= begins[k] < ends[k] <= parts[j].end
        elif ends[k] > begins[k]:  # a token with characters outside every part: the newline
            assert text[begins[k]:ends[k]] == "\n"
    assert owner[-1] == -1  # EOS: no characters, no part
    # Byte-level tokens: every character of both lines is credited, the newline is not.
    assert sum(j == 0 for j in owner) == 13 and sum(j == 1 for j in owner) == 8


def test_each_answer_takes_its_own_advantage(tokenizer, task):
    group = group_of(tokenizer, SHEETS)
    for c in group.completions:
        c.reward = task.score(group.problem, c.text)
    (group,), _ = compute_advantages([group], "grpo", drop_zero=False)
    metrics = assign_answer_credit([group], task, "grpo", tokenizer)
    expected = {"A": grpo([1, 0, 1, 1]), "B": grpo([1, 1, 0, 0]), "C": grpo([0, 1, 1, 0])}
    for i, c in enumerate(group.completions):
        ends = token_char_ends(tokenizer, c.completion_ids)
        begins = [0, *ends[:-1]]
        parts = {p.key: p for p in task.answer_parts(group.problem, c.text)}
        for k, adv in enumerate(c.token_advantages):
            line = next((p for p in parts.values() if p.start <= begins[k] and ends[k] <= p.end and ends[k] > begins[k]),
                        None)
            want = group.advantages[i] if line is None else expected[line.key][i]
            if i == 3 and begins[k] >= len(c.text):  # its ending: stopping left C out
                want += expected["C"][3]
            assert adv == pytest.approx(want), (i, k, c.text[begins[k]:ends[k]])
    # "Let me think." and every newline keep the sequence advantage.
    first = group.completions[3]
    assert first.token_advantages[0] == pytest.approx(group.advantages[3])
    assert 0 < metrics["train/answer_credit_frac"] < 1
    assert metrics["train/stopped_early_frac"] == pytest.approx(0.25)


def test_stopping_before_the_last_questions_takes_their_advantage(tokenizer, task):
    """A question left out by stopping early is pushed like one answered wrong: the ending (EOS)
    takes its advantage on top of the completion's own. A question skipped in the middle, and a
    completion with no answer at all, add nothing."""
    texts = ["A. Mrs. White\nB. Knife\nC. Library",   # all right
             "A. Mrs. White\nB. Knife\nC. Hall",      # C wrong
             "A. Mrs. White\nB. Knife",                # C left out by stopping
             "A. Mrs. White\nC. Library",              # B skipped in the middle
             "I do not know."]                          # nothing answered
    group = group_of(tokenizer, texts)
    for c in group.completions:
        c.reward = task.score(group.problem, c.text)
    (group,), _ = compute_advantages([group], "grpo", drop_zero=False)
    metrics = assign_answer_credit([group], task, "grpo", tokenizer)
    adv_c = grpo([1, 0, 0, 1, 0])
    stopped, skipped, silent = group.completions[2:]
    assert stopped.token_advantages[-1] == pytest.approx(group.advantages[2] + adv_c[2])
    assert adv_c[2] < 0 and stopped.token_advantages[-1] < group.advantages[2]
    for k in (1, 3, 4):  # the EOS of the others keeps the completion's own advantage
        assert group.completions[k].token_advantages[-1] == pytest.approx(group.advantages[k])
    # Leaving C out now costs what answering it wrong costs, on one token where the choice was made.
    assert stopped.token_advantages[-1] - group.advantages[2] == pytest.approx(adv_c[1])
    assert silent.token_advantages == pytest.approx([group.advantages[4]] * len(silent.token_advantages))
    assert skipped.token_advantages[-1] == pytest.approx(group.advantages[3])
    assert metrics["train/stopped_early_frac"] == pytest.approx(1 / 4)  # of the four that answered


def test_the_configured_estimator_is_applied_per_answer(tokenizer, task):
    group = group_of(tokenizer, SHEETS[:3])
    (group,), _ = compute_advantages([group], "rloo", drop_zero=False)
    assign_answer_credit([group], task, "rloo", tokenizer)
    c = group.completions[1]  # "A. Miss Scarlet": A wrong while the two others got it right
    ends = token_char_ends(tokenizer, c.completion_ids)
    assert c.token_advantages[ends.index(len("A. Miss Scarlet"))] == pytest.approx(rloo([1, 0, 1])[1])


def test_a_group_with_equal_totals_still_has_a_signal(tokenizer, task):
    group = group_of(tokenizer, SHEETS[:3])  # every sheet has two of three right: zero sequence advantage
    for c in group.completions:
        c.reward = task.score(group.problem, c.text)
    (group,), _ = compute_advantages([group], "grpo", drop_zero=False)
    assert not has_signal(group, 1e-12)
    assign_answer_credit([group], task, "grpo", tokenizer)
    assert has_signal(group, 1e-12)
    # Each line's first token: per question the advantages over the group sum to zero, not all zero.
    for key, start in (("A", 0), ("B", None), ("C", None)):
        firsts = []
        for c in group.completions:
            at = start if start is not None else c.text.index(f"\n{key}.") + 1
            ends = token_char_ends(tokenizer, c.completion_ids)
            firsts.append(c.token_advantages[next(k for k, e in enumerate(ends) if e > at)])
        assert sum(firsts) == pytest.approx(0.0, abs=1e-6) and max(map(abs, firsts)) > 0.5, key
    batch = pack_groups([group], 512)  # and they reach the packed row
    assert float(batch.rows[0].advantages.abs().max()) > 0.5


def test_each_answer_earns_its_own_format_score(tokenizer):
    """With algorithm.format_reward each answer's reward is its correctness plus the weight times
    its own format score: a listed choice on line A earns w even when wrong, a room named there
    earns nothing, so line A carries a signal though no sheet gets A right."""
    problem = Problem("p", [], dict(SOLUTION), {"choices": {"A": ["Mrs. White", "Miss Scarlet", "Mr. Green"],
                                                           "B": ["Knife", "Rope", "Wrench"],
                                                           "C": ["Library", "Ballroom", "Hall"]}})
    task = TemporalClueTask(load_config(None, []).task)
    texts = ["A. Miss Scarlet\nB. Rope\nC. Library", "A. Library\nB. Rope\nC. Library",
             "A. Mr. Green\nB. Rope\nC. Hall", "A. Library\nB. Rope\nC. Library"]
    group = group_of(tokenizer, texts)
    group.problem = problem
    parts = task.answer_parts(problem, texts[1])
    assert [(p.key, p.reward, p.format_score) for p in parts] == [("A", 0.0, 0.0), ("B", 0.0, 1.0), ("C", 1.0, 1.0)]
    (group,), _ = compute_advantages([group], "grpo", drop_zero=False)
    first_tokens = {}
    for weight in (0.0, 0.5):
        assign_answer_credit([group], task, "grpo", tokenizer, format_weight=weight)
        first_tokens[weight] = [c.token_advantages[0] for c in group.completions]
    assert first_tokens[0.0] == [0.0] * 4  # A is wrong on every sheet: no signal without the format term
    assert first_tokens[0.5] == pytest.approx(grpo([0.5, 0.0, 0.5, 0.0]))
    c_line = texts[2].index("C.")  # C: right (1.5) on three sheets, a listed but wrong choice (0.5) on one
    c = group.completions[2]
    k = next(k for k, e in enumerate(token_char_ends(tokenizer, c.completion_ids)) if e > c_line)
    assert c.token_advantages[k] == pytest.approx(grpo([1.5, 1.5, 0.5, 1.5])[2])


def test_bad_token_advantages_are_refused(tokenizer):
    group = group_of(tokenizer, SHEETS[:2])
    group.advantages = [0.5, -0.5]
    group.completions[0].token_advantages = [1.0]
    with pytest.raises(UserError, match="completion 0: token_advantages must be"):
        pack_groups([group], 512)
    group.completions[0].token_advantages = [float("nan")] * len(group.completions[0].completion_ids)
    with pytest.raises(UserError, match="token_advantages"):
        pack_groups([group], 512)


def test_credit_on_a_task_without_answer_parts_is_a_note(tmp_path, task, capsys):
    """The temporal_clue recipe sets algorithm.credit=answer; a task that grades a completion as a
    whole keeps sequence credit, and start-up says so in one note."""
    assert check_credit(load_config(None, ["algorithm.credit=answer"]), task) is None
    math_file = tmp_path / "m.jsonl"
    math_file.write_text('{"problem": "1+1", "answer": 2}\n')
    args = ["task.name=math", f"task.train_path={math_file}", f"task.eval_path={math_file}"]
    cfg = load_config(None, [*args, "algorithm.credit=answer"])
    from sleuth.tasks.math import MathTask

    note = check_credit(cfg, MathTask(cfg.task))
    assert note is not None and "task 'math' grades a completion as a whole" in note
    assert "keep sequence credit" in note
    assert check_credit(load_config(None, args), MathTask(cfg.task)) is None
    # with no config another task starts from the config classes' defaults: nothing to note
    assert main(["train", "--dry-run", "task.eval_size=2", *args]) == 0
    assert "sleuth: note:" not in capsys.readouterr().err
    # a Temporal Clue recipe named for another task: refused in one line (a recipe is for its own task)
    for recipe in ("temporal_clue", "temporal_clue_direct"):
        assert main(["train", recipe, "task.eval_size=2", *args, "--dry-run"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "task.name is math" in err[0], err
    assert main(["train", "--dry-run", "task.eval_size=2", "algorithm.credit=answers"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "algorithm.credit" in err[0]


def masked_text(tokenizer, c: Completion) -> str:
    ends = token_char_ends(tokenizer, c.completion_ids)
    return "".join(c.text[b:e] for b, e, m in zip([0, *ends[:-1]], ends, c.loss_mask, strict=True) if m)


def test_loss_on_answers_keeps_only_the_values(tokenizer, task):
    group = group_of(tokenizer, [*SHEETS, "I do not know."])
    metrics = mask_to_answers([group], task, tokenizer)
    # The tokenizer joins the space after each label to the value's first token (" Mrs"): kept.
    assert masked_text(tokenizer, group.completions[0]) == " Mrs. White Knife Ballroom"
    assert masked_text(tokenizer, group.completions[1]) == " Miss Scarlet Knife Library"
    assert masked_text(tokenizer, group.completions[3]) == " Mrs. White Rope"  # the preamble carries no loss
    assert group.completions[0].loss_mask[-1] == 0  # nor does EOS
    assert group.completions[4].loss_mask is None  # no answer found: every token keeps its loss
    kept = sum(sum(c.loss_mask or [1] * len(c.completion_ids)) for c in group.completions)
    total = sum(len(c.completion_ids) for c in group.completions)
    assert metrics["train/loss_token_frac"] == pytest.approx(kept / total) and 0.3 < kept / total < 0.8
    for c in group.completions:
        c.reward = task.score(group.problem, c.text)
    (group,), _ = compute_advantages([group], "grpo", drop_zero=False)
    batch = pack_groups([group], 1024)  # packing trains on exactly the masked tokens
    assert sum(len(r.target_ids) for r in batch.rows) == kept


def test_loss_on_answers_needs_structured_output_and_answer_parts(tmp_path, task, capsys):
    check_credit(load_config(None, ["algorithm.loss_on=answers", "rollout.structured_output=true"]), task)
    with pytest.raises(ConfigError, match=r"needs rollout\.structured_output=true"):
        check_credit(load_config(None, ["algorithm.loss_on=answers"]), task)
    math_file = tmp_path / "m.jsonl"
    math_file.write_text('{"problem": "1+1", "answer": 2}\n')
    cfg = load_config(None, ["task.name=math", f"task.train_path={math_file}", f"task.eval_path={math_file}",
                             "algorithm.loss_on=answers", "rollout.structured_output=true"])
    from sleuth.tasks.math import MathTask

    with pytest.raises(ConfigError, match=r"algorithm\.loss_on=answers: task 'math' does not locate"):
        check_credit(cfg, MathTask(cfg.task))
    assert main(["train", "--dry-run", "task.eval_size=2", "algorithm.loss_on=answers"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "rollout.structured_output" in err[0]


DEDUCED = [
    "Deductions:\nA: clue 1 => Mrs. White\nB: clue 2 => Knife\nC: clue 3 => Ballroom\nAnswers:\n"
    "A. Mrs. White\nB. Knife\nC. Ballroom",
    "Deductions:\nA: clue 1 => Miss Scarlet\nB: clue 2 => Knife\nC: clue 3 => Library\nAnswers:\n"
    "A. Miss Scarlet\nB. Knife\nC. Library",
    "Deductions:\nA: clue 1 => Mrs. White\nC: clue 3 => Library\nAnswers:\nA. Mrs. White\nB. Wrench",
]


@pytest.mark.parametrize("deduction_credit", [False, True])
def test_deduction_lines_take_their_question_s_advantage(tokenizer, deduction_credit):
    """deduce form: with task.temporal_clue.deduction_credit each `X: ... => answer` line takes
    question X's advantage like its sheet line (a line for a question the sheet leaves out counts
    as unanswered); without it the deduction keeps the completion's advantage."""
    cfg = load_config(None, ["task.temporal_clue.reasoning=deduce",
                             f"task.temporal_clue.deduction_credit={str(deduction_credit).lower()}"])
    task = TemporalClueTask(cfg.task)
    group = group_of(tokenizer, DEDUCED)
    for c in group.completions:
        c.reward = task.score(group.problem, c.text)
    (group,), _ = compute_advantages([group], "grpo", drop_zero=False)
    assign_answer_credit([group], task, "grpo", tokenizer)
    expected = {"A": grpo([1, 0, 1]), "B": grpo([1, 1, 0]), "C": grpo([0, 1, 0])}  # sheet 3 has no C
    for i, c in enumerate(group.completions):
        ends = token_char_ends(tokenizer, c.completion_ids)
        begins = [0, *ends[:-1]]
        head = c.text.index("Answers:")
        for line in c.text[:head].splitlines()[1:]:
            at = c.text.index(line)
            inside = [k for k in range(len(ends)) if at <= begins[k] and ends[k] <= at + len(line) and ends[k] > begins[k]]
            assert inside
            want = expected[line[0]][i] if deduction_credit else group.advantages[i]
            assert [c.token_advantages[k] for k in inside] == pytest.approx([want] * len(inside)), (i, line)
        # the "Deductions:" header keeps the completion's advantage either way
        assert c.token_advantages[0] == pytest.approx(group.advantages[i])
