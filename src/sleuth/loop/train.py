"""The RL recipe: sample tasks, generate, score, advantages, pack + train, sync, evaluate, checkpoint.

    result = train(load_config("cfg.yaml"), Path("runs/x"))            # a new run
    result = train(load_config("runs/x/config.yaml"), Path("runs/x"), resume=True)

`train` is the whole loop in one function; `Run` holds the objects it works with. Every random
choice of iteration i is seeded from (loop.seed, i) and every rollout request carries its own
sampling seed, so a run resumed from the checkpoint after iteration i redoes iteration i + 1
exactly as an uninterrupted run would.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import torch

from sleuth.config import Config, dump_config
from sleuth.eval.evaluate import (
    EvalResult,
    eval_sampling,
    evaluate,
    evaluate_episodes,
    kind_lines,
)
from sleuth.gateway.runner import EpisodeRunner
from sleuth.loop.batch import Batch, Sampler
from sleuth.loop.budget import FINAL_EVAL_MARGIN, TimeBudget
from sleuth.loop.checks import check_run, check_sections
from sleuth.loop.queue import RolloutQueue, drop_stale
from sleuth.loop.sft import SftResult, warm_start
from sleuth.loop.stream import GroupStream
from sleuth.loop.summary import budget_text, print_final, summary_line, val_text
from sleuth.records import Group, Problem, SamplingParams
from sleuth.rewards.verifier import VerifierRunner
from sleuth.rollout.base import RolloutEngine
from sleuth.rollout.sync import WeightSync
from sleuth.rollout.sync_check import make_sync_check
from sleuth.run.checkpoint import CheckpointManager
from sleuth.run.init import warm_start_dir
from sleuth.run.interrupt import InterruptFlag
from sleuth.run.metrics import MetricsWriter, prefixed, timed
from sleuth.run.progress import Progress
from sleuth.system import fsio
from sleuth.system.allocator import return_free_memory
from sleuth.system.hardware import reproducible_cpu_math, resolve_dtype
from sleuth.system.models import resolve_model_path
from sleuth.system.seeds import derive_seed, seed_everything
from sleuth.tasks.base import Task
from sleuth.tasks.curriculum import Curriculum, level_name, parse_schedule
from sleuth.tasks.user import find_rollout
from sleuth.train.policy import Policy
from sleuth.train.step import Trainer

if TYPE_CHECKING:  # imported for real only when cluster.trainer_workers > 1 (it needs Ray)
    from sleuth.cluster.trainer_group import TrainerGroup

EVAL_SEED_TAG = "run-eval"
"""Evaluation sampling seeds derive from (this, loop.seed) only, fixed across the run, so before and
after compare the same draws."""


@dataclass
class Run:
    """The objects one training run works with (built by `setup`)."""

    cfg: Config
    run_dir: Path
    task: Task
    policy: Policy | TrainerGroup
    """With cluster.trainer_workers > 1 the TrainerGroup of FSDP2 ranks, which is also `trainer`."""
    trainer: Trainer | TrainerGroup
    engine: RolloutEngine
    sync: WeightSync
    writer: MetricsWriter
    checkpoints: CheckpointManager
    verifier: VerifierRunner
    eval_problems: list[Problem]
    dtype: str
    """The model dtype in use (model.dtype with auto resolved for this machine)."""
    start_iteration: int = 0
    state: dict[str, Any] = field(default_factory=dict)
    """Carried across checkpoints: val_before, the latest val_reward, data position, budget, curriculum."""
    episodes: Any = None
    """Episode tasks: the EpisodeRunner (gateway + the task's rollout function); None otherwise."""
    tasks: dict[int, Task] = field(default_factory=dict)
    cluster: Any = None
    """The Ray cluster the workers run on (cluster/runtime.py), None when the run is one process."""

    def task_for_level(self, level: int) -> Task:
        """The training task at a curriculum level (built once; the held-out set stays `task`'s)."""
        if level not in self.tasks:
            from sleuth.tasks.registry import build_task

            self.tasks[level] = build_task(self.cfg.task, level)
        return self.tasks[level]


@dataclass
class RunResult:
    run_dir: Path
    iterations_done: int
    interrupted: bool
    val_before: dict[str, Any] | None
    val_after: dict[str, Any] | None
    stop_signal: int = 0
    """The signal that stopped an interrupted run (SIGINT or SIGTERM)."""


def setup(cfg: Config, run_dir: Path, resume: bool, budget: TimeBudget | None = None,
          out: TextIO | None = None) -> Run | SftResult:
    """Build task, policy, trainer, engine and writers; restore the latest checkpoint on resume."""
    from sleuth.rollout.factory import engine_kind, make_engine, vllm_available

    run_dir.mkdir(parents=True, exist_ok=True)
    check_sections(cfg)  # first: a cluster that cannot hold the workers fails before any loading
    cluster, placement = None, []
    if cfg.cluster.uses_ray:
        from sleuth.cluster.runtime import start_cluster

        cluster, placement = start_cluster(cfg.cluster)
        cluster.watch_raylet(run_dir)
    seed_everything(cfg.loop.seed, 0, cfg.loop.deterministic)
    cfg, task = check_run(cfg)  # the same checks as --dry-run; cfg as config.yaml records it
    eval_problems = list(task.eval_problems())[: cfg.task.eval_size] if cfg.loop.evaluate else []
    dtype = resolve_dtype(cfg.model.dtype)
    model_cfg = cfg.model.model_copy(update={"dtype": dtype})
    model_path = str(resolve_model_path(cfg.model.path))
    if cluster is None and engine_kind(cfg.rollout) == "vllm" and vllm_available():  # before the policy
        from sleuth.rollout.vllm_weights import check_beside_trainer

        check_beside_trainer(model_path)
    if cfg.sft.warm_start:  # 0. the supervised warm start (loop/sft.py) in RUN_DIR/sft, after every check
        warm = warm_start(cfg, run_dir, resume, 0.0 if budget is None else budget.elapsed_s(), out)
        if warm is not None and warm.interrupted:
            return warm
        if warm is not None:  # its model and optimizer are gone: their pages go back before RL's engine starts
            print(f"warm start: {return_free_memory():.2f} GiB returned to the system", file=sys.stderr)
    checkpoints = CheckpointManager(run_dir / "checkpoints", keep_last=cfg.loop.keep_checkpoints)
    policy: Policy | TrainerGroup
    trainer: Trainer | TrainerGroup
    if cfg.cluster.trainer_workers > 1:  # FSDP2 ranks on Ray: the group is both policy and trainer
        from sleuth.cluster.trainer_group import TrainerGroup

        policy = trainer = TrainerGroup.from_config(cfg.model_copy(update={"model": model_cfg}), placement,
                                                    checkpoints.directory, seed=torch.initial_seed())
        print("\n".join(policy.placement_lines()), file=sys.stderr)
    else:
        policy = Policy.from_config(model_cfg, need_reference=cfg.algorithm.kl_beta > 0)
        trainer = Trainer(policy, cfg.algorithm, cfg.trainer, total_steps=cfg.loop.iterations,
                          max_tokens=cfg.rollout.max_tokens)
    start, state = 0, {}
    latest = checkpoints.restore_latest(policy, trainer) if resume else None
    init = str(warm_start_dir(run_dir)) if cfg.sft.warm_start else cfg.model.init
    if init is not None and latest is None:  # a warm start (sleuth sft); not over a checkpoint
        from sleuth.run.init import load_init

        print(f"model.init: starting from {load_init(policy, cfg.model.model_copy(update={'init': init}))}",
              file=sys.stderr)
    if latest is not None:
        state = latest.state
        start = int(state["iteration"])
        if (latest.path / "metrics.jsonl").exists():  # the metrics as they were at that checkpoint
            fsio.write_bytes(run_dir / "metrics.jsonl", (latest.path / "metrics.jsonl").read_bytes())
    # Written only now that the run has started (config valid, model and checkpoint loaded), so a
    # failed start, e.g. a --resume with a bad override, never rewrites the run's config.
    fsio.write_text(run_dir / "config.yaml", dump_config(cfg))
    writer = MetricsWriter(run_dir, cfg.logging, config=cfg.model_dump(mode="json"))
    if resume:  # forget what was logged after the checkpoint (everything, when there is none)
        writer.truncate_after(start if latest is not None else -1)
    if cluster is not None:  # rollout workers on Ray; weights reach them as cluster.weight_transport says
        from sleuth.cluster.rollout_pool import RolloutPool

        engine: RolloutEngine = RolloutPool.from_config(cfg, placement, model_path, dtype)
        print("\n".join(engine.placement_lines()), file=sys.stderr)
        sync = WeightSync(policy, engine, cluster_transport(cfg, placement, policy, engine),
                          check=make_sync_check(policy, engine, cfg.rollout.sync_check_tolerance, dtype))
    else:
        engine = make_engine(cfg.rollout, model_path, dtype, cfg.loop.seed)
        sync = WeightSync(policy, engine, check=make_sync_check(policy, engine, cfg.rollout.sync_check_tolerance, dtype))
    # The engine starts from the base checkpoint's weights: give it the trained ones, or (quantized
    # base) the dequantized ones the trainer really computes with, so rollouts stay on-policy.
    if start > 0 or cfg.model.quantization != "none" or init is not None:
        sync.push()
    verifier = VerifierRunner.from_config(task, cfg.task)
    rollout_fn = find_rollout(cfg.task, task)
    episodes = None if rollout_fn is None else EpisodeRunner(rollout_fn, engine, policy.tokenizer, cfg.task.episode,
                                                             train_sampling(cfg))
    return Run(cfg, run_dir, task, policy, trainer, engine, sync, writer, checkpoints, verifier, eval_problems,
               dtype, start, state, episodes, cluster=cluster)


def cluster_transport(cfg: Config, placement: list[Any], policy: Any, pool: Any) -> Any:
    """RayTransport (the object store) or a CollectiveTransport from the weights' holder (the
    driver's policy, or trainer rank 0) to the rollout workers (cluster.weight_transport)."""
    from sleuth.cluster.collective import CollectiveTransport, LocalSender, choose_backend
    from sleuth.rollout.sync import RayTransport

    gpus = {kind: any(a.spec.gpus > 0 for a in placement if a.spec.kind == kind) for kind in ("trainer", "rollout")}
    trainer_on_gpu = gpus["trainer"] if cfg.cluster.trainer_workers > 1 else policy.device.type == "cuda"
    backend = choose_backend(cfg.cluster.weight_transport, trainer_on_gpu, gpus["rollout"])
    if backend is None:
        return RayTransport()
    sender = policy if cfg.cluster.trainer_workers > 1 else LocalSender(policy)
    transport = CollectiveTransport(pool, sender, backend, cfg.cluster.sync_timeout_s)
    transport.connect()
    return transport


def train_sampling(cfg: Config) -> SamplingParams:
    return SamplingParams(temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                          max_tokens=cfg.rollout.max_tokens, stop=tuple(cfg.rollout.stop))


def train(cfg: Config, run_dir: Path, resume: bool = False, out: TextIO | None = None,
          progress: Progress | None = None, elapsed_before_s: float = 0.0) -> RunResult:
    """Run (or continue) the RL loop of `cfg` in `run_dir`. Prints one summary line per iteration
    to `out` (None: sys.stdout as it is at the call, not as it was when this module was imported).
    `elapsed_before_s`: time this run spent before the call (the CLI's start-up), counted against
    loop.time_budget_min."""
    out = out if out is not None else sys.stdout
    L = cfg.loop
    if L.deterministic:  # before any matmul of this run (model loading checks run some)
        reproducible_cpu_math()
    # Started before setup: loading counts against the budget.
    budget = TimeBudget(L.time_budget_min, elapsed_before_s=elapsed_before_s)
    run = setup(cfg, run_dir, resume, budget, out)
    if isinstance(run, SftResult):  # stopped in the warm start, its checkpoint saved
        return RunResult(run_dir, 0, True, None, None, run.stop_signal)
    cfg = run.cfg  # as resolved at start-up (structured.resolve_guided_samples)
    budget.restore(run.state.get("budget"))
    progress = progress or Progress()
    curriculum = Curriculum(parse_schedule(cfg.task.temporal_clue.difficulty), run.state.get("curriculum_stage", 0),
                            fade=cfg.task.temporal_clue.curriculum_fade, since=run.state.get("curriculum_since", 0))
    queue = _make_queue(run, progress)
    if cfg.model.dtype == "auto":
        print(f"model dtype: auto -> {run.dtype}", file=out, flush=True)
    done, finished = run.start_iteration, False
    interrupted, stop_signal = False, 0
    try:
        with InterruptFlag() as interrupt, progress:
            if run.start_iteration == 0 and run.eval_problems and "val_before" not in run.state:
                _evaluate_before(run, queue, progress, budget, out)
            bar = progress.bar("iterations", total=L.iterations, completed=run.start_iteration)
            for it in range(run.start_iteration + 1, L.iterations + 1):
                if not budget.allows_next():  # only after a resume whose budget was already spent
                    break
                t_iter = time.perf_counter()  # time/iteration_s: every step, logging excluded
                seed_everything(L.seed, it, L.deterministic)

                # 1-4. The batch (loop/batch.py): draw problems at the data position, generate (or run
                #      episodes), score (+ over-length penalty), group advantages, drop zero-advantage
                #      groups; with DAPO dynamic sampling, more rounds until the batch is full.
                batch, metrics = _take_batch(run, queue, curriculum, budget, it)
                if interrupt.requested:
                    break

                # 5. Pack groups into rows (shared prompts) and take the optimizer step, while an
                #    engine idle until the sync has handed its KV cache's memory back.
                queue.release_engine_memory()
                with timed(metrics, "train"):
                    # (an empty batch still counts as a step, so the schedule does not depend on luck)
                    metrics.update(prefixed("train", _train_step(run, batch.groups, progress)))
                run.state.update(queue.trained_state(batch))  # trained up to here: where a resume draws next

                # 6. Sync the updated weights into the rollout engine (adapter-only with LoRA where
                #    the engine serves adapters, else full weights; sleuth.rollout.sync decides), after any
                #    generation under way; then the curriculum moves on if this batch earned it.
                metrics.update(queue.sync(run.sync, version=it, changed=bool(batch.groups)))
                if run.cluster is not None:  # restarted rollout workers so far (each re-synced)
                    metrics.update(_pool_metrics(run.engine.stats()))
                _climb(run, curriculum, batch, it, out)

                # 7. Evaluate on schedule and after the last iteration (the budget's or the config's).
                budget.record(time.perf_counter() - t_iter)
                last = it == L.iterations or not budget.allows_next()
                val = None
                if run.eval_problems and ((L.eval_every and it % L.eval_every == 0) or last):
                    val = _evaluate_on_schedule(run, queue, it, last, progress, metrics)

                # 8. Log, and checkpoint on schedule, at the end, or when interrupted.
                metrics["time/iteration_s"] = time.perf_counter() - t_iter
                metrics["time/elapsed_min"] = budget.elapsed_s() / 60
                run.writer.log(it, metrics)
                print(summary_line(it, L.iterations, metrics), file=out, flush=True)
                done = it
                progress.advance(bar)
                if (L.checkpoint_every and it % L.checkpoint_every == 0) or last or interrupt.requested:
                    run.state["budget"] = budget.state()
                    _checkpoint(run, it, val)
                if interrupt.requested or last:
                    finished = last and not interrupt.requested
                    break
            interrupted, stop_signal = interrupt.requested, interrupt.signum
            latest = run.checkpoints.latest()
            if interrupted and (latest is None or latest.iteration < done):  # stopped mid-iteration
                run.state["budget"] = budget.state()
                _checkpoint(run, done, None)
        queue.close()
        if not interrupted:
            _export_final(run)
    finally:
        queue.close()
        _close(run)
    print(budget_text(done, L.iterations, budget), file=out, flush=True)
    before, after = run.state.get("val_before"), run.state.get("val_last")
    if finished and before and after:
        print_final(run.task, run.eval_problems, run.state, out)
    return RunResult(run_dir, done, interrupted, before, after if finished else None,
                     stop_signal if interrupted else 0)


# ---------------------------------------------------------------- the steps' details


def _take_batch(run: Run, queue: RolloutQueue | GroupStream, curriculum: Curriculum, budget: TimeBudget,
                it: int) -> tuple[Batch, dict[str, Any]]:
    """Steps 1-4: iteration `it`'s batch at the curriculum's level; the next iterations' batches
    started ahead (overlap, as far as loop.max_staleness and the budget allow); groups generated
    by weights older than the bound dropped."""
    L = run.cfg.loop
    batch = queue.take(it, curriculum.level_for(it, L.seed))
    for ahead in range(it + 1, min(it + L.max_staleness, L.iterations) + 1):
        if budget.allows_next(ahead=ahead - it):  # overlap: generate while this one trains
            queue.prefetch(ahead, curriculum.level_for(ahead, L.seed))
    batch, stale = drop_stale(batch, trainer_version=it - 1, max_staleness=L.max_staleness)
    metrics: dict[str, Any] = batch.metrics | {"rollout/stale_dropped": float(stale),
                                               "rollout/positions": list(batch.positions)}
    return batch, metrics


def _pool_metrics(stats: dict[str, float]) -> dict[str, float]:
    """Ray rollout workers restarted so far (each re-synced) and broadcasts that fell back."""
    return {"rollout/worker_restarts": stats.get("worker_restarts", 0.0),
            "sync/broadcast_fallbacks": stats.get("broadcast_fallbacks", 0.0)}


def _climb(run: Run, curriculum: Curriculum, batch: Batch, it: int, out: TextIO) -> None:
    """The curriculum moves on if this batch earned it; only a batch at the current level counts
    (a fading older level's never does). Its position goes into the run's state."""
    batch_level = int(batch.metrics.get("rollout/difficulty", curriculum.level))
    if curriculum.update(batch.reward_mean, it, batch_level):
        print(f"curriculum: reward {batch.reward_mean:.3f} -> difficulty {level_name(curriculum.level)}",
              file=out, flush=True)
    run.state["curriculum_stage"], run.state["curriculum_since"] = curriculum.index, curriculum.since


def _make_queue(run: Run, progress: Progress) -> RolloutQueue | GroupStream:
    """Where batches come from: a queue of iterations (with overlap up to loop.max_staleness) or,
    with loop.streaming, groups generated continuously (loop/stream.py); both resume at the data
    position the last checkpoint recorded."""
    L = run.cfg.loop
    sampler = Sampler(run.cfg, run.policy.tokenizer, run.engine, run.verifier, run.task_for_level, progress,
                      run.episodes)
    position = run.state.get("data_position", run.start_iteration * L.tasks_per_iteration)
    queue: RolloutQueue | GroupStream = (
        GroupStream(sampler, L, position, run.start_iteration, run.state.get("stream_pending")) if L.streaming
        else RolloutQueue(sampler, L.max_staleness, version=run.start_iteration, position=position))
    run.state.setdefault("data_position", queue.position)
    return queue


def _evaluate_before(run: Run, queue: RolloutQueue | GroupStream, progress: Progress, budget: TimeBudget,
                     out: TextIO) -> None:
    """The held-out reward before the first iteration; the budget keeps time for the last one."""
    cfg = run.cfg
    before = queue.run(_evaluate, run, 0, progress, budget)
    run.state["val_before"] = before.summary() | {"per_problem": before.per_problem}
    # kept for the last evaluation (and, with eval.ablate_clues, its clue-free repeat)
    budget.reserve_s = FINAL_EVAL_MARGIN * before.time_s * (2 if cfg.eval.ablate_clues else 1)
    when = "at the start of RL (after the warm start)" if cfg.sft.warm_start else "before training"
    print(f"held-out reward {when}: {val_text(before.summary())}", file=out, flush=True)
    for line in kind_lines(before.per_kind):
        print(line, file=out, flush=True)


def _evaluate_on_schedule(run: Run, queue: RolloutQueue | GroupStream, it: int, last: bool, progress: Progress,
                          metrics: dict[str, Any]) -> EvalResult:
    """Step 7: the held-out evaluation into `metrics` and the run's state; after the last iteration,
    with eval.ablate_clues, the same problems again without their clues (paired)."""
    val = queue.run(_evaluate, run, it, progress)
    metrics.update(_val_metrics(val))
    run.state["val_last"] = val.summary() | {"per_problem": val.per_problem}
    if last and run.cfg.eval.ablate_clues:
        ablated = queue.run(_evaluate, run, it, progress, None, "ablate_clues")
        run.state["val_ablated"] = ablated.summary()
        metrics.update(prefixed("val/ablate_clues", {"reward": ablated.avg, "reward_se": ablated.avg_se}))
    return val


def _close(run: Run) -> None:
    """Stop what the run started: writers, the verifier pool, the engine, and on Ray the workers."""
    run.writer.close()
    run.verifier.close()
    run.engine.close()
    if run.cluster is not None:
        if not isinstance(run.trainer, Trainer):  # a TrainerGroup: stop the FSDP2 ranks' actors
            run.trainer.close()
        run.cluster.shutdown()


def _train_step(run: Run, groups: list[Group], progress: Progress) -> dict[str, float]:
    """The trainer's step with a bar over its packed rows (x epochs)."""
    bar = progress.bar("training", total=None)

    def on_row(done: int, total: int) -> None:
        progress.update(bar, completed=done, total=total)

    try:
        return run.trainer.step(groups, on_row=on_row)
    finally:
        progress.remove(bar)


def _evaluate(run: Run, iteration: int, progress: Progress, budget: TimeBudget | None = None,
              diagnostic: str | None = None) -> EvalResult:
    """The held-out evaluation; with `diagnostic` (e.g. "ablate_clues") the same problems changed
    (Task.diagnostic_problems), with the same sampling seeds, logged as nothing but its metrics."""
    cfg = run.cfg
    problems = run.eval_problems
    if diagnostic is not None:
        problems = run.task.diagnostic_problems(diagnostic, problems, cfg.loop.seed)
    bar = progress.bar("evaluation" if diagnostic is None else diagnostic.replace("_", " "), total=None)
    try:
        if run.episodes is not None:
            result = evaluate_episodes(run.episodes, problems, cfg.eval.k, eval_sampling(cfg),
                                       seed=derive_seed(EVAL_SEED_TAG, cfg.loop.seed))
        else:
            result = evaluate(run.engine, run.task, run.policy.tokenizer, problems, cfg.eval.k,
                              eval_sampling(cfg), run.verifier, seed=derive_seed(EVAL_SEED_TAG, cfg.loop.seed),
                              structured=cfg.rollout.structured_output)
    finally:
        progress.remove(bar)
    if result.warning:
        print(f"sleuth: warning: {result.warning}", file=sys.stderr)
    if diagnostic is not None:
        return result
    if iteration == 0:  # the reward before training, at the minute it was measured
        elapsed = {} if budget is None else {"time/elapsed_min": budget.elapsed_s() / 60}
        run.writer.log(0, _val_metrics(result) | elapsed)
    if cfg.logging.samples_per_eval:
        run.writer.log_samples(iteration, _best_and_worst(result, cfg.logging.samples_per_eval))
    return result


def _val_metrics(val: EvalResult) -> dict[str, Any]:
    k = val.k
    out = {"val/reward": val.avg, "val/reward_se": val.avg_se, f"val/pass@{k}": val.pass_k,
           f"val/maj@{k}": val.maj, "val/completion_tokens": val.mean_completion_tokens,
           "time/eval_s": val.time_s}
    if val.chance is not None:
        out["val/chance"] = val.chance
    if val.constant is not None:
        out["val/constant"] = val.constant
    if val.first_choice is not None:
        out["val/first_choice"] = val.first_choice
    for kind, v in val.per_kind.items():  # report.html's per-kind curves
        out[f"val/kind/{kind}"] = v["mean"]
    return out


def _best_and_worst(val: EvalResult, groups: int) -> list[dict[str, Any]]:
    """The best and worst sample of the first `groups` held-out problems."""
    by_problem: dict[str, list[dict[str, Any]]] = {}
    for rec in val.records:
        by_problem.setdefault(rec["problem_id"], []).append(rec)
    out = []
    for pid in list(by_problem)[:groups]:
        recs = by_problem[pid]
        best = max(recs, key=lambda r: r["reward"])
        worst = min(recs, key=lambda r: r["reward"])
        out.append(best | {"kind": "best"})
        if worst is not best:
            out.append(worst | {"kind": "worst"})
    return out


def _checkpoint(run: Run, iteration: int, val: EvalResult | None) -> None:
    run.writer.flush()
    state = {k: v for k, v in run.state.items() if k != "iteration"}
    state.update(val_reward=None if val is None else val.avg)
    run.checkpoints.save(iteration, run.policy, run.trainer, state, metrics_file=run.writer.metrics_path)


def _export_final(run: Run) -> None:
    """RUN_DIR/model: the trained weights merged into a plain HF folder (what `--model RUN_DIR` loads)."""
    with fsio.atomic_folder(run.run_dir / "model") as tmp:
        run.policy.export_merged(tmp)
