"""What a training run prints: the iteration line, the budget line, held-out rewards, and the
final checks (paired gain, margin over the best constant answer, the clue-free repeat)."""

from __future__ import annotations

from typing import Any, TextIO

from sleuth.eval.evaluate import constant_margin_line, kind_lines
from sleuth.eval.stats import constant_margin, mean_se
from sleuth.loop.budget import TimeBudget
from sleuth.records import Problem
from sleuth.tasks.base import Task


def summary_line(it: int, total: int, m: dict[str, Any]) -> str:
    """One iteration's line: training reward, held-out reward when evaluated, loss, speed, times."""
    val = f"  val {m['val/reward']:.3f}±{m['val/reward_se']:.3f}" if "val/reward" in m else ""
    loss = f"  loss {m['train/loss']:+.4f}" if "train/loss" in m else ""
    return (
        f"iter {it}/{total}  reward {m['rollout/reward_mean']:.3f}{val}{loss}  "
        f"{m['rollout/tokens_per_s']:.0f} tok/s  gen {m['time/rollout_s']:.1f}s score {m['time/score_s']:.1f}s "
        f"train {m['time/train_s']:.1f}s sync {m['time/sync_s']:.1f}s"
    )


def budget_text(done: int, total: int, budget: TimeBudget) -> str:
    """The closing line: iterations reached in how many minutes, and why none when none fitted."""
    limit = "" if budget.limit_s is None else f" of the {budget.limit_s / 60:.4g}-minute budget"
    text = f"reached iteration {done} of {total} in {budget.elapsed_s() / 60:.1f} minutes{limit}"
    if budget.limit_s is not None and done == 0 and total > 0:  # e.g. a slow CPU: evaluations ate the budget
        text += (f": no iteration fitted beside the {budget.reserve_s / 60:.1f} minutes kept for the last "
                 "evaluation; raise loop.time_budget_min")
    return text


def val_text(v: dict[str, Any]) -> str:
    """A held-out summary (EvalResult.summary()) beside the chance level and the best constant answer."""
    chance = "unknown" if v.get("chance") is None else f"{v['chance']:.3f}"
    constant = "" if v.get("constant") is None else f", best constant answer {v['constant']:.3f}"
    level = "" if v.get("difficulty") is None else f" at difficulty {v['difficulty']}"
    return (f"{v['avg']:.3f} ± {v['avg_se']:.3f} (avg@{v['k']} over {v['problems']} problems{level}; "
            f"chance {chance}{constant})")


def final_checks(task: Task, problems: list[Problem], after: dict[str, Any], ablated: dict[str, Any] | None) -> list[str]:
    """The trained policy against the best constant answer and, with eval.ablate_clues, against
    itself without the clues: both paired per problem, in standard errors."""
    margin = constant_margin_line(constant_margin(task, problems, after["per_problem"]))
    lines = [margin] if margin else []
    if ablated is not None:
        diff, se = mean_se([b - a for a, b in zip(after["per_problem"], ablated["per_problem"], strict=True)])
        lines.append(f"clues removed: {ablated['avg']:.3f} ± {ablated['avg_se']:.3f}, paired difference "
                     f"{diff:+.3f} ± {se:.3f} ({diff / se if se else 0.0:+.1f} SE)")
    return lines


def print_final(task: Task, problems: list[Problem], state: dict[str, Any], out: TextIO) -> None:
    """After a finished run: the held-out reward, per kind before -> after, the paired gain, and
    the checks against the best constant answer and (eval.ablate_clues) the clue-free repeat."""
    before, after = state["val_before"], state["val_last"]
    print(f"held-out reward after training:  {val_text(after)}", file=out)
    for line in kind_lines(before.get("per_kind") or {}, after.get("per_kind") or {}):
        print(line, file=out)
    print(gain_text(before, after), file=out, flush=True)
    for line in final_checks(task, problems, after, state.get("val_ablated")):
        print(line, file=out, flush=True)


def gain_text(before: dict[str, Any], after: dict[str, Any]) -> str:
    """The gain with its paired standard error (the same problems and sampling seeds both times)."""
    diffs = [a - b for a, b in zip(after["per_problem"], before["per_problem"], strict=True)]
    gain, se = mean_se(diffs)
    return f"gain {gain:+.3f} ± {se:.3f} ({gain / se if se else 0.0:+.1f} SE, paired)"
