"""Training-step time against model.lora.last_layers, on the default run's batch shape.

    .venv/bin/python bench/lora_layers.py [--layers all,15,8] [--reps 3] [--smoke]

The default's step: SmolLM2-135M with LoRA rank 16, 4 groups of 8 completions (prompt 830 tokens,
completions 40 tokens, random ids), one optimizer step per group (trainer.mini_batches=4), in the
dtype `model.dtype: auto` picks. With LoRA on the last N of the 30 decoder layers the layers below
have nothing to train, so autograd records nothing there: their backward (and the activations
kept for it) is gone, their forward stays. Each setting is timed side by side in one process, the
best of --reps steps kept. Last line: speedup of the last setting over `all`. --smoke: the tiny model
(2 layers: all and 1), prompts of a tenth, one timed step.
"""

from __future__ import annotations

import argparse
import time

from _smoke import add_smoke_flag, tiny_model_folder
from sleuth.config import AlgorithmConfig, LoraConfig, ModelConfig, TrainerConfig
from sleuth.system.hardware import cpu_description
from sleuth.train.policy import Policy
from sleuth.train.step import Trainer
from train_step import make_groups

PROMPT, COMPLETION, GROUPS = 830, 40, 4


def time_steps(last_layers: int | None, reps: int, dtype: str = "auto", model: str | None = None,
               prompt: int = PROMPT) -> tuple[float, int]:
    """(best step seconds, trainable parameters) for one setting (bench/reproducible_math.py too);
    `model`: a folder instead of the default's model (the tiny one for --smoke)."""
    cfg = ModelConfig(dtype=dtype, lora=LoraConfig(enabled=True, rank=16, alpha=32, last_layers=last_layers))
    if model is not None:
        cfg = cfg.model_copy(update={"path": model})
    policy = Policy.from_config(cfg, need_reference=False)
    trainer = Trainer(policy, AlgorithmConfig(), TrainerConfig(row_tokens=2048, mini_batches=GROUPS,
                                                               self_check=False), max_tokens=COMPLETION)
    vocab = policy.causal_lm.config.vocab_size
    groups = make_groups(GROUPS, prompt, COMPLETION, vocab, seed=0)
    trainer.step(groups)  # warm-up: first-call allocations
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        trainer.step(groups)
        best = min(best, time.perf_counter() - start)
    return best, sum(p.numel() for p in trainer.params)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", default="all,15,8", help="comma-separated last_layers values (all = every layer)")
    ap.add_argument("--reps", type=int, default=3)
    add_smoke_flag(ap)
    args = ap.parse_args()
    model, prompt = None, PROMPT
    if args.smoke:
        args.layers, args.reps, model, prompt = "all,1", 1, tiny_model_folder(), PROMPT // 10
    try:
        settings = [None if s.strip() == "all" else int(s) for s in args.layers.split(",")]
    except ValueError:
        ap.error(f"--layers {args.layers!r}: expected 'all' or integers, comma-separated")
    if any(s is not None and s < 1 for s in settings):
        ap.error(f"--layers {args.layers!r}: layer counts must be at least 1")
    print(f"# cpu: {cpu_description()}")
    print(f"# {GROUPS} groups x 8 completions, prompt {prompt} + completion {COMPLETION} tokens, "
          f"mini_batches={GROUPS}, best of {args.reps}")
    print(f"{'last_layers':>11} {'trainable':>10} {'step_s':>7} {'speedup':>7}")
    base = None
    speedup = 1.0
    for last in settings:
        seconds, params = time_steps(last, args.reps, model=model, prompt=prompt)
        base = seconds if base is None else base
        speedup = base / seconds
        print(f"{'all' if last is None else last:>11} {params:>10,} {seconds:>7.2f} {speedup:>6.2f}x", flush=True)
    print(f"speedup={speedup:.2f}")


if __name__ == "__main__":
    main()
