"""Learning per minute: the embedded default against each lever of issue 14 and their combination.

    .venv/bin/python bench/learning.py [--minutes 4] [--arms default,dynamic,...] [--seeds 0] [--out DIR] [--smoke]

Every arm is `sleuth train` (the embedded default config) with the arm's overrides and a wall-clock
budget of --minutes (loop.time_budget_min), run in a fresh process one after another. All arms
evaluate the same held-out puzzles with the same sampling seeds (before training, every
--eval-every iterations and after the last), so their held-out rewards are comparable point by point.
The table gives, per arm and seed, the iterations reached, the minutes the run took, the held-out
reward before and after and the paired gain with its standard error; then the held-out reward
against wall-clock minutes (the curve `sleuth report RUN_DIR` plots for each run). The last line is
the final combination's: final_val, chance, minutes, gain_se (the gain in paired standard errors),
averaged over seeds.

The combination is fixed in advance (every lever that keeps the task as it is) and nothing is tuned
on the held-out set.

--diagnostics N: after each run, `sleuth eval RUN_DIR --ablate-clues --permute-options` on N held-out
puzzles (one sample each) adds two columns, each paired per puzzle against the unchanged puzzles:
`ablate` (clues removed: a policy that reads the clues drops) and `permute` (listed choices moved to
other positions: a policy that reasons does not move), as difference ± standard error.
--smoke: the `default` arm for one iteration on the tiny model (_smoke.default_run_overrides);
with --diagnostics N the diagnostic pass follows on that run (the tests run both).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _smoke import add_smoke_flag, default_run_overrides, tiny_model_folder
from sleuth.eval.stats import mean_se
from sleuth.run.checkpoint import CheckpointManager
from sleuth.run.metrics import read_metrics
from sleuth.system.hardware import cpu_description

RAW = ["algorithm.constrained_logprobs=false"]
TOP = ["rollout.guided_samples=0"]
"""The embedded default from the evening of 2026-12-04 (the `top` arm's configuration) until the
`guided` arm's guided sample joined it that night: the arms of _OVER_TOP were measured over it and
keep it underneath."""
SHEET = [*TOP, "model.lora.last_layers=null"]
"""The embedded default from 2026-12-04 16:10 until the `top` arm's LoRA on the last 15 layers
joined it the same evening (the `sheet` arm's levers, LoRA on every layer): the arms of
_OVER_SHEET were measured over it and keep it underneath."""
EARLIER = [*SHEET, "algorithm.credit=sequence", "algorithm.format_reward=0", "trainer.mini_batches=1",
           "task.temporal_clue.stop_after_sheet=false"]
"""The embedded default until 2026-12-04 16:10 (before `sheet` became it): every arm of _ARMS was
measured against it and keeps it underneath, so its figures in docs/benchmarks.md stay reproducible."""
_ARMS: dict[str, list[str]] = {
    "earlier": [],
    "dynamic": ["algorithm.dynamic_sampling=true"],
    "overlong": ["algorithm.mask_truncated=true", "algorithm.overlong_buffer=16"],
    "overlap": ["loop.max_staleness=1"],
    "curriculum": ["task.temporal_clue.difficulty=1 -> 2 at 0.6"],
    "format": ["algorithm.format_reward=0.5"],
    "bf16": ["model.dtype=bfloat16"],
    # Structured output with the trainer scoring the raw model (as first measured) ...
    "structured": [*RAW, "rollout.structured_output=true"],
    "credit": [*RAW, "rollout.structured_output=true", "algorithm.credit=answer"],
    "credit_lr": [*RAW, "rollout.structured_output=true", "algorithm.credit=answer", "trainer.lr=1e-3"],
    "answers": [*RAW, "rollout.structured_output=true", "algorithm.credit=answer", "algorithm.loss_on=answers"],
    # ... and scoring the constrained policy that sampled (algorithm.constrained_logprobs, the default).
    "constrained": ["rollout.structured_output=true", "algorithm.credit=answer"],
    "constrained_lr": ["rollout.structured_output=true", "algorithm.credit=answer", "trainer.lr=1e-3"],
    # Re-tuning for reward per minute (chosen before either was run): a 3x learning rate, and
    # groups of 4 samples (more updates in the budget, on noisier group baselines). Measured for
    # 15 minutes, neither kept (docs/benchmarks.md, "learning").
    "lr": ["trainer.lr=1e-3"],
    "small_groups": ["rollout.samples_per_task=4"],
    # Four more, each fixed from the training side of earlier runs and measured once, none kept
    # (docs/benchmarks.md, "learning"): per-answer credit without the constraint (each `A. ...`
    # line takes its own question's advantage); the same 32 completions as 2 groups of 16 (half the
    # prompt tokens to train on); a KL term to the untrained policy (DeepSeekMath's GRPO weight)
    # against the entropy collapse that stalls seeds 1 and 2; the 3x learning rate with that KL term.
    "answer_credit": ["algorithm.credit=answer"],
    "big_groups": ["rollout.samples_per_task=16", "loop.tasks_per_iteration=2"],
    "kl": ["algorithm.kl_beta=0.04"],
    "lr_kl": ["trainer.lr=1e-3", "algorithm.kl_beta=0.04"],
    # Per-answer credit with each answer's own format score in its reward (credit.py): a listed
    # choice on a line earns w even when wrong, so a suspect line learns to name a suspect from
    # its own samples instead of from the sheet's total.
    "answer_format": ["algorithm.credit=answer", "algorithm.format_reward=0.5"],
    # The same with one optimizer step per group (trainer.mini_batches=4): four updates an
    # iteration at the same compute, each later group corrected by the IS weight.
    "answer_format_mb": ["algorithm.credit=answer", "algorithm.format_reward=0.5", "trainer.mini_batches=4"],
    # ... and each completion ended where the sheet ends (task.temporal_clue.stop_after_sheet): no answers to
    # questions that do not exist, whose room names took the whole completion's advantage.
    # The stop alone on the default: which part of `sheet` the gain comes from.
    "stop": ["task.temporal_clue.stop_after_sheet=true"],
    "sheet": ["algorithm.credit=answer", "algorithm.format_reward=0.5", "trainer.mini_batches=4",
              "task.temporal_clue.stop_after_sheet=true"],
    "combined": ["algorithm.dynamic_sampling=true", "algorithm.mask_truncated=true",
                 "algorithm.overlong_buffer=16", "loop.max_staleness=1"],
}
_OVER_SHEET: dict[str, list[str]] = {
    # Over the `sheet` default, fixed before any was run: format learning took most
    # of the 15 minutes of every `sheet` seed (listed choices on 14% of answer lines at the start,
    # 70-100% at the end), so a format term as large as a right answer's ...
    "format_1": ["algorithm.format_reward=1.0"],
    # LoRA on the last 15 of the 30 layers (model.lora.last_layers): the backward pass stops
    # halfway down, the default's step 20.8 -> 13.7 s (bench/lora_layers.py), so more iterations
    # fit in the budget, each with half the adapter. (Planned with format_1 underneath; format_1
    # did not hold over seeds, 0.488 / 0.150 / 0.201, so measured over the default itself.)
    "top": ["model.lora.last_layers=15"],
}
_OVER_TOP: dict[str, list[str]] = {
    # Over the `top` default (2026-12-04 evening), fixed before any was run: seed 1 settles on a
    # room name on every line by iteration ~12 (token entropy 1.26 -> 0.10) and a line on which all
    # eight samples agree has no advantage left, so an entropy bonus (verl's entropy_coeff,
    # SkyRL's entropy_loss_coef; 0.01 is the latter's value) keeps the samples apart for longer.
    "entropy": ["algorithm.entropy_coef=0.01"],
    # On seed 1 that bonus held the entropy near 1 for 20 iterations without the format moving,
    # then the entropy ran away (3-6.5, sheets running into max_tokens): a tenth of it.
    "entropy_small": ["algorithm.entropy_coef=0.001"],
    # Exploration within the listed choices instead: one of each group's eight samples drawn under
    # the answer sheet's pattern (rollout.guided_samples), so a line on which the seven free samples
    # all write a room name still has a sample naming one of its listed choices, and an advantage.
    # Above chance on seeds 0-3, now the default.
    "guided": ["rollout.guided_samples=1"],
}
_OVER_DEFAULT: dict[str, list[str]] = {
    # The ladder below difficulty 1 (issue 42), fixed before any was run: climb from one-clue lookups
    # through one and two eliminations to difficulty 1 as the training reward passes each threshold,
    # the easier rung fading out over 8 iterations; held out at difficulty 1 like every other arm.
    "ladder": ["task.temporal_clue.difficulty=lookup -> elim1 at 0.7 -> elim2 at 0.7 -> 1 at 0.6", "task.temporal_clue.curriculum_fade=8",
               "task.temporal_clue.eval_difficulty=1"],
}
_OVER_WARM: dict[str, list[str]] = {
    # Over the warm-start default (the `temporal_clue` recipe since 2026-12-06): the same minutes
    # without the SFT phase (RL alone on the deduce form), and answering directly instead of
    # deducing (a warm start on the deduction needs the deduce form, so RL alone there too).
    "no_warm_start": ["sft.warm_start=false"],
    # The recipe's RL lr until 2026-12-07 afternoon: from the 24-step warm start, 4 RL iterations
    # at 3e-6 moved a development set +0.3 SE, at 3e-5 +1.6 / +2.0 SE (docs/log.md).
    "rl_lr_3e-6": ["trainer.lr=3e-6"],
}
DIRECT = "temporal_clue_direct"
"""The recipe of the main job until 2026-12-06 (direct answers at difficulty 1, LoRA, 16 held-out
puzzles): `direct` runs it as it is, and every arm measured before that day keeps it underneath."""
ARMS: dict[str, list[str]] = {"default": ["temporal_clue"], "direct": [DIRECT],
                              **{name: [DIRECT, *EARLIER, *o] for name, o in _ARMS.items()},
                              **{name: [DIRECT, *SHEET, *o] for name, o in _OVER_SHEET.items()},
                              **{name: [DIRECT, *TOP, *o] for name, o in _OVER_TOP.items()},
                              **{name: [DIRECT, *o] for name, o in _OVER_DEFAULT.items()},
                              **{name: ["temporal_clue", *o] for name, o in _OVER_WARM.items()}}
"""Each arm: a recipe name, then its overrides. `default` is the main job as it is now (the
`temporal_clue` recipe); `direct` the main job before it (`guided`'s configuration); the arms of
_OVER_TOP change the `top` default, those of _OVER_SHEET the `sheet` default, the rest of the older
arms the earlier one, all over the `temporal_clue_direct` recipe."""
DEFAULT_ARMS = "default,no_warm_start,direct"


def run_arm(name: str, seed: int, minutes: float, eval_every: int, out: Path,
            extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """`extra`: overrides after the arm's own (--smoke's tiny model and sizes)."""
    run_dir = out / f"{name}-seed{seed}"
    args = [sys.executable, "-m", "sleuth", "train", *ARMS[name], f"loop.time_budget_min={minutes}",
            f"loop.eval_every={eval_every}", f"loop.seed={seed}", "loop.iterations=1000",
            "logging.tensorboard=false", *extra, "--out", str(run_dir)]
    start = time.perf_counter()
    proc = subprocess.run(args, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"arm {name} seed {seed} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return summarize(run_dir, name, seed, wall)


def summarize(run_dir: Path, name: str, seed: int, wall_s: float) -> dict[str, Any]:
    rows = read_metrics(run_dir)
    latest = CheckpointManager(run_dir / "checkpoints").latest()
    if latest is None:  # the budget was spent before a first iteration could start
        before = after = {"avg": rows[0]["val/reward"], "chance": rows[0].get("val/chance"), "per_problem": [0.0]}
    else:
        before, after = latest.state["val_before"], latest.state["val_last"]
    diffs = [a - b for a, b in zip(after["per_problem"], before["per_problem"], strict=True)]
    gain, se = mean_se(diffs)
    curve = [(r["time/elapsed_min"], r["val/reward"]) for r in rows if "val/reward" in r]
    return {"arm": name, "seed": seed, "iterations": rows[-1]["iteration"], "wall_min": wall_s / 60,
            "run_min": rows[-1]["time/elapsed_min"], "before": before["avg"], "after": after["avg"],
            "chance": before.get("chance"), "gain": gain, "gain_se": se, "curve": curve}


def diagnose(model: str | Path, out: Path, size: int, overrides: list[str] = ()) -> dict[str, Any]:  # type: ignore[assignment]
    """`sleuth eval MODEL --ablate-clues --permute-options` on `size` held-out puzzles, one sample
    each: the unchanged score, and each diagnostic's paired difference with its standard error."""
    args = [sys.executable, "-m", "sleuth", "eval", "--model", str(model), "--k", "1", "--ablate-clues",
            "--permute-options", "--out", str(out), f"task.eval_size={size}", *overrides]
    proc = subprocess.run(args, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"diagnostics of {model} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    summary = json.loads((out / "summary.json").read_text())
    d = summary["diagnostics"]
    return {"avg": summary["avg"], "avg_se": summary["avg_se"], "constant": summary["constant"],
            "chance": summary["chance"], "eval_s": summary["time_s"], "per_kind": summary["per_kind"],
            **{f"{name}_{key}": d[name][key] for name in ("ablate_clues", "permute_options")
               for key in ("difference", "difference_se", "time_s") if key in d[name]}}


def _diag(r: dict[str, Any], name: str) -> str:
    if f"{name}_difference" not in r:
        return ""
    return f" {r[f'{name}_difference']:>+7.3f}±{r[f'{name}_difference_se']:.3f}"


def print_table(results: list[dict[str, Any]]) -> None:
    diag = any("ablate_clues_difference" in r for r in results)
    print(f"{'arm':<14} {'seed':>4} {'iters':>5} {'run_min':>7} {'wall_min':>8} {'before':>6} {'after':>6} "
          f"{'chance':>6} {'gain':>7} {'se':>6}" + (f" {'ablate':>13} {'permute':>13}" if diag else ""))
    for r in results:
        print(f"{r['arm']:<14} {r['seed']:>4} {r['iterations']:>5} {r['run_min']:>7.2f} {r['wall_min']:>8.2f} "
              f"{r['before']:>6.3f} {r['after']:>6.3f} {r['chance'] or math.nan:>6.3f} {r['gain']:>+7.3f} "
              f"{r['gain_se']:>6.3f}{_diag(r, 'ablate_clues')}{_diag(r, 'permute_options')}")
    print("\nheld-out reward against wall-clock minutes (minutes:reward)")
    for r in results:
        points = "  ".join(f"{m:.2f}:{v:.3f}" for m, v in r["curve"])
        print(f"{r['arm']:<14} {r['seed']:>4}  {points}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=4.0, help="time budget of each run")
    parser.add_argument("--arms", default=DEFAULT_ARMS, help=f"comma-separated, from {', '.join(ARMS)}")
    parser.add_argument("--seeds", default="0", help="comma-separated loop.seed values")
    parser.add_argument("--eval-every", type=int, default=4, help="iterations between held-out evaluations")
    parser.add_argument("--out", default=None, help="where the runs go (default: a temporary folder)")
    parser.add_argument("--reuse", action="store_true",
                        help="summarize runs already complete in --out instead of running them again")
    parser.add_argument("--diagnostics", type=int, default=0, metavar="N",
                        help="after each run, clue ablation and option permutation on N held-out puzzles")
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.diagnostics < 0:
        parser.error(f"--diagnostics {args.diagnostics}: expected a number of puzzles >= 0")
    extra: tuple[str, ...] = ()
    if args.smoke:
        args.arms, args.seeds, args.minutes = "default", "0", 5.0
        extra = (*default_run_overrides(), "loop.iterations=1")
        args.out = args.out or str(Path(tiny_model_folder()).parent / "runs")  # removed at exit with the model
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        parser.error(f"unknown arm(s) {', '.join(unknown)}; choose from {', '.join(ARMS)}")  # exit 2
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        parser.error(f"--seeds {args.seeds!r}: expected comma-separated integers")
    out = Path(args.out or tempfile.mkdtemp(prefix="sleuth-learning-"))
    print(f"# cpu: {cpu_description()}")
    print(f"# {len(arms)} arms x {len(seeds)} seeds, {args.minutes} minutes each, runs in {out}", flush=True)
    results = []
    earlier = json.loads((out / "learning.json").read_text()) if (out / "learning.json").is_file() else []
    walls = {(r["arm"], r["seed"]): r["wall_min"] * 60 for r in earlier}
    for name in arms:
        for seed in seeds:
            done = out / f"{name}-seed{seed}"
            if args.reuse and (done / "model").is_dir():
                results.append(summarize(done, name, seed, walls.get((name, seed), math.nan)))
            else:
                results.append(run_arm(name, seed, args.minutes, args.eval_every, out, extra))
            r = results[-1]
            if args.diagnostics:
                r.update(diagnose(done, done / "eval-diagnostics", args.diagnostics))
            print(f"# {name} seed {seed}: {r['iterations']} iterations, {r['after']:.3f} after "
                  f"({r['gain']:+.3f} ± {r['gain_se']:.3f})", flush=True)
    (out / "learning.json").write_text(json.dumps(results, indent=1))
    print_table(results)
    last = [r for r in results if r["arm"] == arms[-1]]
    final = sum(r["after"] for r in last) / len(last)
    minutes = sum(r["wall_min"] for r in last) / len(last)
    gain_se = sum(r["gain"] / r["gain_se"] if r["gain_se"] > 0 else math.nan for r in last) / len(last)
    chance = last[0]["chance"]
    print(f"final_val={final:.3f} chance={chance if chance is None else round(chance, 3)} "
          f"minutes={minutes:.2f} gain_se={gain_se:.2f}")


if __name__ == "__main__":
    main()
