"""Where the default run's resident memory goes: peak RSS per stage of `sleuth train`.

    .venv/bin/python bench/memory.py [key=value ...]     # overrides on top of the default config
    .venv/bin/python bench/memory.py --smoke [key=value ...]   # the same on the tiny model, in seconds

Runs the default config (plus overrides; default loop.iterations=2) in this process and samples the
resident set (/proc/self/status VmRSS) every 50 ms, attributing each sample to the stage running:
model load, engine start, evaluation, rollout + scoring, training step, weight sync. Prints a table, the
per-iteration times, and one `name=value` line. Peak RSS of the whole process is also measured by
`/usr/bin/time -v` in docs/benchmarks.md; this script says which stage reaches it.

    .venv/bin/python bench/memory.py --step ROW_TOKENS [--steps 3]

The training step alone, in a fresh process: the default's policy (SmolLM2, LoRA r=16, model.dtype
auto) and three Trainer.step calls on default-shaped groups (4 groups x 8 completions, prompt 420
tokens, completions 64 tokens, random ids) packed into rows of ROW_TOKENS; prints each step's time
and resident set after it, and the process's peak (ru_maxrss). Run it under different glibc malloc
settings (e.g. MALLOC_MMAP_THRESHOLD_=262144) to compare allocators.
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from _smoke import default_run_overrides
from sleuth.cli.train import default_config_path
from sleuth.config import load_config
from sleuth.loop import batch as sampling
from sleuth.loop import train as loop
from sleuth.rollout import factory
from sleuth.rollout.sync import WeightSync
from sleuth.run.metrics import read_metrics
from sleuth.system.allocator import allocator_in_use, resident_gib
from sleuth.system.hardware import cpu_description

GB = 1024**3


def rss_bytes() -> int:
    return round(resident_gib() * GB)


class StageMeter:
    """Peak RSS per stage label, sampled by a thread while the stages run in the main thread."""

    def __init__(self) -> None:
        self.stage = "start-up"
        self.peaks: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            rss = rss_bytes()
            self.peaks[self.stage] = max(self.peaks.get(self.stage, 0), rss)
            time.sleep(0.05)

    def wrap(self, owner: Any, name: str, label: str) -> None:
        original = getattr(owner, name)
        meter = self

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            previous, meter.stage = meter.stage, label
            try:
                return original(*args, **kwargs)
            finally:
                meter.peaks[label] = max(meter.peaks.get(label, 0), rss_bytes())
                meter.stage = previous if previous != label else "between steps"

        setattr(owner, name, wrapped)

    def __enter__(self) -> StageMeter:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def step_only(row_tokens: int, steps: int) -> None:
    """Trainer steps alone on default-shaped groups: time and resident memory."""
    import resource

    from sleuth.config import AlgorithmConfig, LoraConfig, ModelConfig, TrainerConfig
    from sleuth.system.hardware import resolve_dtype
    from sleuth.system.models import SMOLLM2_ALIAS, resolve_model_path
    from sleuth.train.policy import Policy
    from sleuth.train.step import Trainer
    from train_step import make_groups  # bench/train_step.py: the same random-id groups

    print(f"# cpu: {cpu_description()}", flush=True)
    print(f"# allocator: {allocator_in_use()}; MALLOC_MMAP_THRESHOLD_={os.environ.get('MALLOC_MMAP_THRESHOLD_', '-')} "
          f"GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES', '-')}", flush=True)
    model_cfg = ModelConfig(path=str(resolve_model_path(SMOLLM2_ALIAS)), dtype=resolve_dtype("auto"),
                            lora=LoraConfig(enabled=True, rank=16, alpha=32))
    policy = Policy.from_config(model_cfg, False, "cpu")
    trainer = Trainer(policy, AlgorithmConfig(), TrainerConfig(lr=3e-4, row_tokens=row_tokens), max_tokens=64)
    base = rss_bytes()
    groups = make_groups(4, 420, 64, policy.causal_lm.config.vocab_size, 0)
    times = []
    print("| step | s | rows | RSS after GB |")
    print("|---|---|---|---|")
    for i in range(steps):
        start = time.perf_counter()
        metrics = trainer.step(groups)
        times.append(time.perf_counter() - start)
        print(f"| {i} | {times[-1]:.1f} | {metrics['rows']:.0f} | {rss_bytes() / GB:.2f} |", flush=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    later = times[1:] or times
    print(f"step_peak_rss_gb={peak / GB:.2f} base_rss_gb={base / GB:.2f} step_s={sum(later) / len(later):.1f}")


def main() -> None:
    if "--step" in sys.argv:
        at = sys.argv.index("--step")
        steps = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else 3
        step_only(int(sys.argv[at + 1]), steps)
        return
    args = [arg for arg in sys.argv[1:] if arg != "--smoke"]
    smoke = default_run_overrides() if len(args) < len(sys.argv[1:]) else []
    overrides = ["loop.iterations=2", *smoke, *args]
    print(f"# cpu: {cpu_description()}", flush=True)
    print(f"# overrides: {' '.join(overrides)}; allocator: {allocator_in_use()}; "
          f"MALLOC_ARENA_MAX={os.environ.get('MALLOC_ARENA_MAX', '-')}", flush=True)
    cfg = load_config(default_config_path(), overrides)
    meter = StageMeter()
    meter.wrap(loop.Policy, "from_config", "policy load")
    meter.wrap(factory, "make_engine", "engine start")
    meter.wrap(loop, "_evaluate", "evaluation")
    meter.wrap(sampling.Sampler, "collect", "rollout + scoring")
    meter.wrap(loop, "_train_step", "training step")
    meter.wrap(WeightSync, "push", "weight sync")
    with meter, tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        loop.train(cfg, Path(tmp) / "run", out=sys.stderr)
        total = time.perf_counter() - start
        rows = read_metrics(Path(tmp) / "run")
    print("| stage | peak RSS GB |")
    print("|---|---|")
    for stage, peak in meter.peaks.items():
        print(f"| {stage} | {peak / GB:.2f} |")
    its = [r for r in rows if r["iteration"] > 0]
    for r in its:
        print(f"# iteration {r['iteration']}: {r.get('time/iteration_s', 0):.1f} s (rollout "
              f"{r.get('time/rollout_s', 0):.1f}, train {r.get('time/train_s', 0):.1f}, "
              f"sync {r.get('time/sync_s', 0):.2f})")
    peak = max(meter.peaks.values())
    mean_it = sum(r.get("time/iteration_s", 0.0) for r in its) / max(len(its), 1)
    print(f"peak_rss_gb={peak / GB:.2f} iteration_s={mean_it:.1f} total_s={total:.0f}")


if __name__ == "__main__":
    main()
