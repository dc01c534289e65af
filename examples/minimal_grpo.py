"""The whole GRPO loop in one readable file, built from sleuth's pieces.

    python examples/minimal_grpo.py [section.key=value ...]
    python examples/minimal_grpo.py model.path=/my/model task.name=examples.my_task:problems

Each iteration: draw problems -> sample a group of completions per problem (token ids and
logprobs) -> score them with the task's verifier -> group advantages, dropping groups that carry
no signal -> pack and take one optimizer step -> the rollout engine sees the new weights ->
evaluate now and then. `sleuth train` (src/sleuth/loop/train.py) runs the same stages with
everything around them: checkpoints and exact resume, overlapped rollouts, a wall-clock budget,
Ray workers, vLLM, curricula, per-answer credit, episodes through the gateway.

What this file leaves out, on purpose: no checkpoints, one process, our transformers engine on the
trainer's own model (so the weight sync is a no-op: the engine reads the weights the optimizer just
changed), the config's defaults for everything it does not name.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

from sleuth.config import Config, load_config
from sleuth.eval.evaluate import eval_sampling, evaluate
from sleuth.eval.stats import mean_se
from sleuth.loop.checks import check_run
from sleuth.records import Group, Problem, SamplingParams
from sleuth.rewards.advantages import compute_advantages
from sleuth.rewards.verifier import VerifierRunner, score_groups
from sleuth.rollout.base import GenerationRequest, RolloutEngine, to_groups
from sleuth.rollout.factory import make_engine
from sleuth.system.hardware import resolve_dtype
from sleuth.system.logs import configure_logging
from sleuth.system.models import encode_chat
from sleuth.system.seeds import derive_seed
from sleuth.tasks.base import Task
from sleuth.train.policy import Policy
from sleuth.train.step import Trainer

# The settings this loop reads, over the config's own defaults. Anything can be overridden on the
# command line, e.g. `loop.iterations=20 rollout.samples_per_task=4`.
DEFAULTS = [
    "task.name=examples.my_task:problems",  # two-digit addition: a reward a small model can earn
    "rollout.engine=hf", "rollout.max_tokens=16", "rollout.samples_per_task=8",
    "loop.iterations=10", "loop.tasks_per_iteration=4", "loop.eval_every=5",
    "task.eval_size=20", "eval.k=1",
]


@dataclass
class Parts:
    """Everything one iteration needs, built once."""

    cfg: Config
    task: Task
    policy: Policy
    trainer: Trainer
    engine: RolloutEngine
    verifier: VerifierRunner
    sampling: SamplingParams


def build(cfg: Config) -> Parts:
    """The task, the policy (LoRA or full weights), its optimizer, an engine and the verifier."""
    cfg, task = check_run(cfg)  # the start-up checks `sleuth train` runs: names, task, cross-field rules
    model_cfg = cfg.model.model_copy(update={"dtype": resolve_dtype(cfg.model.dtype)})
    policy = Policy.from_config(model_cfg, need_reference=cfg.algorithm.kl_beta > 0)
    steps = cfg.loop.iterations * cfg.trainer.mini_batches
    trainer = Trainer(policy, cfg.algorithm, cfg.trainer, total_steps=steps, max_tokens=cfg.rollout.max_tokens)
    # Our transformers engine on the trainer's own model: rollouts always see the latest weights.
    engine = make_engine(cfg.rollout, cfg.model.path, model_cfg.dtype, cfg.loop.seed,
                         model=policy.model, tokenizer=policy.tokenizer)
    verifier = VerifierRunner.from_config(task, cfg.task)
    r = cfg.rollout
    sampling = SamplingParams(temperature=r.temperature, top_p=r.top_p, max_tokens=r.max_tokens, stop=tuple(r.stop))
    return Parts(cfg, task, policy, trainer, engine, verifier, sampling)


def draw(parts: Parts, iteration: int) -> list[Problem]:
    """This iteration's problems: the next slice of the task's deterministic training stream."""
    n = parts.cfg.loop.tasks_per_iteration
    return [parts.task.train_problem((iteration - 1) * n + i) for i in range(n)]


def rollout(parts: Parts, problems: list[Problem], iteration: int) -> list[Group]:
    """One group of samples_per_task completions per problem, token ids and logprobs as sampled."""
    prompts = [encode_chat(parts.policy.tokenizer, p.messages) for p in problems]
    requests = []
    for i, (p, ids) in enumerate(zip(problems, prompts)):
        seeded = SamplingParams(**{**parts.sampling.__dict__, "seed": derive_seed(parts.cfg.loop.seed, iteration, i)})
        requests.append(GenerationRequest(prompt_ids=ids, n=parts.cfg.rollout.samples_per_task,
                                          sampling=seeded, request_id=f"{iteration}-{p.id}"))
    return to_groups(problems, prompts, parts.engine.generate_all(requests))


def rewards(parts: Parts, groups: list[Group]) -> tuple[list[Group], dict[str, float]]:
    """Verifier rewards in place, then group advantages; groups whose rewards are all equal carry
    no signal and are dropped (OpenPipe's zero-advantage drop)."""
    stats = score_groups(parts.verifier, groups)
    kept, adv = compute_advantages(groups, parts.cfg.algorithm.advantage, drop_zero=True)
    all_rewards = [c.reward for g in groups for c in g.completions]
    mean, se = mean_se(all_rewards)
    return kept, {"reward": mean, "reward_se": se, "groups_kept": float(len(kept)),
                  "verifier_errors": float(stats.verifier_errors), **{f"adv/{k}": v for k, v in adv.items()}}


def train_step(parts: Parts, groups: list[Group]) -> dict[str, float]:
    """Pack the groups (each prompt once, its completions after it) and take the optimizer step(s)."""
    if not groups:
        return {"loss": 0.0}
    return parts.trainer.step(groups)


def held_out(parts: Parts) -> tuple[float, float]:
    """avg@k on the task's held-out problems (the same decoding every time)."""
    problems = list(parts.task.eval_problems())[: parts.cfg.task.eval_size]
    result = evaluate(parts.engine, parts.task, parts.policy.tokenizer, problems, parts.cfg.eval.k,
                      eval_sampling(parts.cfg), parts.verifier, seed=parts.cfg.loop.seed)
    return result.avg, result.avg_se


def main(argv: list[str]) -> int:
    configure_logging()  # the engines' own logs only with SLEUTH_LOG=debug
    parts = build(load_config(None, [*DEFAULTS, *argv]))
    L = parts.cfg.loop
    with parts.verifier:
        before = held_out(parts)
        print(f"held-out reward before training: {before[0]:.3f} ± {before[1]:.3f}", flush=True)
        for it in range(1, L.iterations + 1):
            start = time.perf_counter()
            problems = draw(parts, it)                      # 1. tasks
            groups = rollout(parts, problems, it)           # 2. rollouts (token ids + logprobs)
            kept, stats = rewards(parts, groups)            # 3. rewards -> advantages
            metrics = train_step(parts, kept)               # 4. pack + optimizer step
            # 5. weight sync: none needed, the engine runs on the trained model itself
            line = (f"iter {it}/{L.iterations}  reward {stats['reward']:.3f}  groups {int(stats['groups_kept'])}"
                    f"/{len(groups)}  loss {metrics.get('loss', 0.0):+.4f}  grad {metrics.get('grad_norm', 0.0):.3g}"
                    f"  {time.perf_counter() - start:.1f}s")
            if L.eval_every and it % L.eval_every == 0 and it < L.iterations:
                line += "  val {:.3f}±{:.3f}".format(*held_out(parts))  # 6. evaluation on a schedule
            print(line, flush=True)
        after = held_out(parts)
    parts.engine.close()
    print(f"held-out reward after training:  {after[0]:.3f} ± {after[1]:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
