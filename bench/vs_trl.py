"""Seconds per RL iteration: TRL's GRPOTrainer against sleuth on the same work.

Same model (SmolLM2-135M-Instruct, float32, LoRA r=16 alpha=32 on all linear layers), same
prompts (the first Temporal Clue difficulty-1 training puzzles with the choices listed, in the
same order), same samples per prompt, max new tokens, temperature 1, learning rate, number of
steps; CPU; transformers generation in both (TRL's `generate`, sleuth's hf engine); no KL term, no
evaluation, no checkpoints inside the timed steps. One iteration = generate the group of every
prompt, score, one optimizer step (and, for sleuth, sync the weights into its engine).

    .venv/bin/python bench/vs_trl.py [--prompts 2 --samples 4 --max-tokens 64 --steps 3] [--smoke]

The first iteration of each includes one-off costs (sleuth's packing self-check, lazy inits), so
the headline is the mean over the iterations after the first. Last line:
`trl_s_per_iter=… sleuth_s_per_iter=… speedup=…`. --smoke: the tiny model, 1 prompt x 2 samples x 8 new
tokens, 2 iterations.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from io import StringIO
from pathlib import Path
from typing import Any

from _smoke import add_smoke_flag, tiny_model_folder

LR = 1e-4


def problems(n: int) -> list[Any]:
    from sleuth.config import TaskConfig
    from sleuth.tasks.temporal_clue.task import TemporalClueTask

    task = TemporalClueTask(TaskConfig(name="temporal_clue", temporal_clue={"difficulty": 1, "list_choices": True}))
    return [task.train_problem(i) for i in range(n)]


def steady(times: list[float]) -> float:
    rest = times[1:] if len(times) > 1 else times
    return sum(rest) / len(rest)


def run_sleuth(model: str, a: argparse.Namespace) -> list[float]:
    from sleuth.config import load_config
    from sleuth.loop.train import train
    from sleuth.run.metrics import read_metrics

    cfg = load_config(None, [
        f"model.path={model}", "model.dtype=float32", "model.lora.rank=16", "model.lora.alpha=32",
        "task.name=temporal_clue", "task.temporal_clue.difficulty=1", "task.temporal_clue.list_choices=true",
        "rollout.engine=hf", f"rollout.samples_per_task={a.samples}", f"rollout.max_tokens={a.max_tokens}",
        "rollout.temperature=1.0", f"trainer.lr={LR}", f"loop.iterations={a.steps}",
        f"loop.tasks_per_iteration={a.prompts}", "loop.evaluate=false", "loop.checkpoint_every=0",
        # TRL trains on every group, even when all its rewards are equal; so does sleuth here.
        "algorithm.drop_zero_advantage=false",
        "logging.tensorboard=false", "algorithm.kl_beta=0",
    ])
    with tempfile.TemporaryDirectory() as tmp:
        train(cfg, Path(tmp) / "run", out=StringIO())
        rows = read_metrics(Path(tmp) / "run")
    return [r["time/iteration_s"] for r in rows if r["iteration"] >= 1]


def run_trl(model: str, a: argparse.Namespace) -> list[float]:
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from sleuth.system.models import load_causal_lm, load_tokenizer
    from sleuth.tasks.temporal_clue.grade import grade

    rows = [{"prompt": p.messages, "solution": json.dumps(p.answer)} for p in problems(a.prompts * a.steps)]

    def reward(completions: list[Any], solution: list[str], **_: Any) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [grade(json.loads(s), t) for t, s in zip(texts, solution, strict=True)]

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.last = 0.0

        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.last = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            now = time.perf_counter()
            self.times.append(now - self.last)
            self.last = now

    timer = StepTimer()
    with tempfile.TemporaryDirectory() as tmp:
        config = GRPOConfig(
            output_dir=tmp, per_device_train_batch_size=a.prompts * a.samples, num_generations=a.samples,
            gradient_accumulation_steps=1, max_completion_length=a.max_tokens, max_steps=a.steps,
            learning_rate=LR, temperature=1.0, beta=0.0, use_cpu=True, bf16=False, report_to="none",
            save_strategy="no", logging_steps=1, shuffle_dataset=False, seed=0, dataloader_num_workers=0,
            disable_tqdm=True,
        )
        trainer = GRPOTrainer(
            model=load_causal_lm(model, "float32"), reward_funcs=reward, args=config,
            train_dataset=Dataset.from_list(rows), processing_class=load_tokenizer(model),
            peft_config=LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"),
            callbacks=[timer],
        )
        trainer.train()
    return timer.times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3)
    add_smoke_flag(parser)
    a = parser.parse_args()
    if a.smoke:
        a.model, a.prompts, a.samples, a.max_tokens, a.steps = tiny_model_folder(), 1, 2, 8, 2
    from sleuth.system.hardware import cpu_description

    print(f"# cpu: {cpu_description()}", flush=True)

    from sleuth.system.models import resolve_model_path

    model = str(resolve_model_path(a.model))
    lengths = [len(json.dumps(p.messages)) for p in problems(a.prompts * a.steps)]
    print(f"work per iteration: {a.prompts} prompts (~{sum(lengths) // len(lengths)} chars each) x {a.samples} "
          f"samples x up to {a.max_tokens} new tokens; {a.steps} iterations; LoRA r=16; float32; CPU")
    sleuth_times = run_sleuth(model, a)
    # Shown as soon as known: the TRL half takes several times longer.
    print("sleuth iteration s: " + " ".join(f"{t:.1f}" for t in sleuth_times), flush=True)
    trl_times = run_trl(model, a)
    print(f"{'system':<8} {'s/iter (after 1st)':>18} {'first iter s':>13}  all iterations s")
    for name, times in (("trl", trl_times), ("sleuth", sleuth_times)):
        print(f"{name:<8} {steady(times):>18.1f} {times[0]:>13.1f}  {' '.join(f'{t:.1f}' for t in times)}")
    t, s = steady(trl_times), steady(sleuth_times)
    print(f"trl_s_per_iter={t:.1f} sleuth_s_per_iter={s:.1f} speedup={t / s:.2f}")


if __name__ == "__main__":
    main()
