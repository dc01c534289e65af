"""Scale-out costs on this machine: weight sync through Ray, and one default iteration on Ray.

    flock /work/locks/heavy .venv/bin/python bench/scale.py [--skip-iteration] [--smoke]

1. Full-weight sync: SmolLM2-135M-Instruct's weights (model.dtype of the default, float32) into one
   rollout worker (transformers engine) through Ray's object store (sleuth.rollout.sync.RayTransport, the
   loop's path) against the same engine in this process (InProcessTransport). Median of 3.
2. LoRA sync: the default's adapter (rank 16, all linear layers) the same two ways. Median of 5.
   Both also through cluster/collective.py's broadcast group (gloo here, the NCCL path's code):
   the driver broadcasts the same buckets to the worker (cluster.weight_transport=collective).
3. One iteration of the embedded default (SmolLM2, LoRA, Temporal Clue, vLLM when installed) with
   1 trainer (the driver) + 1 rollout worker on Ray against the in-process run, both at this
   machine's cores, evaluation off; the second iteration's time/iteration_s is compared (the first
   pays for warm-up). Target: ray_overhead <= 0.10.
4. fsdp2_step_ratio: bench/fsdp_step.py (2 gloo ranks vs 1 process) when it exists.
5. --fsdp-iteration: (3) with 2 FSDP2 trainer ranks and 1 rollout worker as Ray actors (0.5 CPU
   each, a local cluster sleuth starts) against one process; prints fsdp2_loop_overhead=....
6. --memory: the --dry-run trainer estimate (cluster/plan.py) against the measured peak RSS of one
   step of the default (SmolLM2, float32, LoRA) on one full packed row of --row-tokens, in a fresh
   process: the RSS the model load adds vs the "params" estimate, and the peak the step adds over
   that vs "grads + optimizer + activations".
Last line: `sync_gb_s=... lora_sync_ms=... ray_overhead=...` (+ fsdp2_step_ratio=...).
--smoke: 1-3 on the tiny model (one sync per path; the iterations of _smoke.default_run_overrides);
4 is bench/fsdp_step.py's own smoke run. Every part runs the `temporal_clue_direct` recipe (LoRA on
SmolLM2, the main job until 2026-12-06), so its figures stay comparable with the earlier ones.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from _smoke import add_smoke_flag, default_run_overrides, tiny_model_folder
from sleuth.cli.train import recipes
from sleuth.cluster.collective import CollectiveTransport, LocalSender
from sleuth.config import RolloutConfig, load_config
from sleuth.rollout.factory import make_engine
from sleuth.rollout.sync import InProcessTransport, RayTransport
from sleuth.run.metrics import read_metrics
from sleuth.system.hardware import cpu_description
from sleuth.system.models import SMOLLM2_ALIAS, resolve_model_path
from sleuth.train.policy import Policy

ROOT = Path(__file__).resolve().parents[1]



RECIPE = recipes()["temporal_clue_direct"]
"""What every part runs (the LoRA adapter sync needs LoRA; the main job trains all weights now)."""

def progress(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def timed(fn, reps: int) -> tuple[float, int]:
    """Median seconds of fn() over reps, and the bytes it reported."""
    times, moved = [], 0
    for _ in range(reps):
        t = time.perf_counter()
        moved = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), moved


def bench_sync(folder: str, overrides: tuple[str, ...] = (), reps: tuple[int, int] = (3, 5)) -> dict[str, float]:
    """`overrides` on the default config (the tiny model for --smoke); `reps`: full, LoRA syncs per path."""
    import ray

    from sleuth.cluster.rollout_pool import RolloutPool
    from sleuth.cluster.runtime import WorkerSpec

    cfg = load_config(RECIPE, list(overrides))
    policy = Policy.from_config(cfg.model, need_reference=False)
    full = [(n, t.contiguous()) for n, t in policy.sync_state()]
    adapter = policy.lora_adapter()
    rollout = RolloutConfig(engine="hf", max_tokens=8)
    local = make_engine(rollout, folder, cfg.model.dtype, 0)
    cores = os.cpu_count() or 2
    ray.init(address="local", num_cpus=cores, include_dashboard=False, log_to_driver=False,
             logging_level="warning", object_store_memory=2 * 1024**3)
    pool = RolloutPool(rollout, cfg.cluster, folder, cfg.model.dtype, 0,
                       [WorkerSpec("rollout", 0, cores, 0)])
    # the same tensors as the other two paths (read once above), so every path does the same work:
    # pack into buckets, move them, load them into the engine
    fixed = SimpleNamespace(is_lora=True, sync_state=lambda: full, lora_adapter=lambda: adapter)
    try:
        progress("full-weight sync")
        full_reps, lora_reps = reps
        ray_full, nbytes = timed(lambda: RayTransport().send_full(pool, full), full_reps)
        local_full, _ = timed(lambda: InProcessTransport().send_full(local, full), full_reps)
        collective = CollectiveTransport(pool, LocalSender(fixed), "gloo", 600)
        collective.connect()
        coll_full, _ = timed(lambda: collective.stage(fixed, "full", False)(pool), full_reps)
        progress("LoRA sync")
        ray_lora, lora_bytes = timed(lambda: RayTransport().send_adapter(pool, adapter), lora_reps)
        local_lora, _ = timed(lambda: InProcessTransport().send_adapter(local, adapter), lora_reps)
        coll_lora, _ = timed(lambda: collective.stage(fixed, "adapter", False)(pool), lora_reps)
        assert collective._restarts_seen == pool.restarts, "the broadcast fell back to the object store"
    finally:
        pool.close()
        local.close()
        ray.shutdown()
    return {"full_bytes": nbytes, "ray_full_s": ray_full, "local_full_s": local_full, "coll_full_s": coll_full,
            "lora_bytes": lora_bytes, "ray_lora_s": ray_lora, "local_lora_s": local_lora, "coll_lora_s": coll_lora}


def one_iteration(on_ray: bool, out: Path, extra: tuple[str, ...] = ()) -> float:
    """time/iteration_s of iteration 2 of the default (evaluation off), in a fresh process; `extra`
    overrides (e.g. cluster.trainer_workers=2, a local Ray cluster that sleuth starts itself)."""
    args = ["loop.iterations=2", "loop.evaluate=false", "loop.checkpoint_every=0", "logging.tensorboard=false",
            *extra]
    code = (
        "import sys, json; from io import StringIO; from pathlib import Path\n"
        "from sleuth.cli.train import recipes; from sleuth.config import load_config\n"
        "from sleuth.loop.train import train\n"
        "args = json.loads(sys.argv[1]); out = Path(sys.argv[2])\n"
        "if sys.argv[3] == 'ray':\n"
        "    import os, ray\n"
        "    ctx = ray.init(address='local', num_cpus=os.cpu_count(), include_dashboard=False,\n"
        "                   log_to_driver=False, logging_level='warning')\n"
        "    args += [f\"cluster.address={ctx.address_info['gcs_address']}\",\n"
        "             f'cluster.cpus_per_worker={os.cpu_count()}']\n"
        "train(load_config(recipes()['temporal_clue_direct'], args), out, out=StringIO())\n"
    )
    subprocess.run([sys.executable, "-c", code, json.dumps(args), str(out), "ray" if on_ray else "local"],
                   check=True, cwd=ROOT)
    last = next(r for r in read_metrics(out) if r["iteration"] == 2)
    return float(last["time/iteration_s"])


MEMORY_CODE = """
import json, resource, sys
import torch
from sleuth.cli.train import recipes
from sleuth.config import load_config
from sleuth.records import Completion, Group, Problem
from sleuth.train.policy import Policy
from sleuth.train.step import Trainer

def rss_gib():  # current resident set size
    return int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize() / 2**30

row = int(sys.argv[1])
cfg = load_config(recipes()["temporal_clue_direct"], [f"trainer.row_tokens={row}", "trainer.self_check=false"])
before = rss_gib()
policy = Policy.from_config(cfg.model, need_reference=False)
loaded = rss_gib()
trainer = Trainer(policy, cfg.algorithm, cfg.trainer, total_steps=2, max_tokens=64)
gen = torch.Generator().manual_seed(0)
prompt = torch.randint(100, 40000, (row - 12 * 64,), generator=gen).tolist()
comps = [Completion(prompt, torch.randint(100, 40000, (64,), generator=gen).tolist(), [-1.0] * 64, "stop", "",
                    reward=float(k % 2)) for k in range(12)]
group = Group(Problem("p", [], None), prompt, comps, advantages=[1.0 if k % 2 else -1.0 for k in range(12)])
trainer.step([group])
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
print(json.dumps({"params": loaded - before, "step": peak - loaded}))
"""


def memory_check(row_tokens: int) -> None:
    from sleuth.cluster.plan import ModelShape, trainer_memory

    proc = subprocess.run([sys.executable, "-c", MEMORY_CODE, str(row_tokens)], capture_output=True, text=True,
                          check=True, cwd=ROOT)
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    cfg = load_config(RECIPE, [f"trainer.row_tokens={row_tokens}"])
    est = trainer_memory(cfg, ModelShape.from_folder(resolve_model_path(cfg.model.path)), 1)
    step_est = est["grads"] + est["optimizer"] + est["activations"]
    print(f"| SmolLM2 LoRA float32, row {row_tokens} tokens | estimate GiB | measured GiB |")
    print("|---|---|---|")
    print(f"| parameters (RSS added by loading) | {est['params']:.2f} | {got['params']:.2f} |")
    print(f"| step peak over that (grads + optimizer + activations) | {step_est:.2f} | {got['step']:.2f} |")
    print(f"memory_estimate_ratio={(est['params'] + step_est) / (got['params'] + got['step']):.2f}")


def fsdp_ratio() -> float | None:
    script = ROOT / "bench" / "fsdp_step.py"
    if not script.exists():
        return None
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=ROOT)
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    for item in last.split():
        key, _, value = item.partition("=")
        if key == "fsdp2_step_ratio":
            return float(value)
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--skip-iteration", action="store_true", help="only the sync figures")
    ap.add_argument("--memory", action="store_true", help="only the memory estimate against a measured peak")
    ap.add_argument("--row-tokens", type=int, default=1024)
    ap.add_argument("--fsdp-iteration", action="store_true",
                    help="only: iteration 2 of the default with 2 FSDP2 trainer ranks + 1 rollout worker on "
                         "Ray (0.5 CPU each) against one process")
    add_smoke_flag(ap)
    a = ap.parse_args()
    # A loaded machine may take longer than the default 30 s to place a worker.
    smoke = (*default_run_overrides(), "cluster.connect_timeout_s=600") if a.smoke else ()
    print(f"CPU: {cpu_description()}; torch threads {torch.get_num_threads()}")
    if a.memory:
        memory_check(a.row_tokens)
        return
    if a.fsdp_iteration:
        ranks = ("cluster.trainer_workers=2", "cluster.cpus_per_worker=0.5", "cluster.object_store_gb=1")
        with tempfile.TemporaryDirectory() as tmp:
            progress("default iteration in one process")
            local = one_iteration(False, Path(tmp) / "local")
            progress("default iteration with 2 FSDP2 ranks and a rollout worker on Ray")
            sharded = one_iteration(False, Path(tmp) / "fsdp", ranks)
        print(f"| iteration 2 of the default | in-process {local:.1f} s | 2 FSDP2 ranks + 1 rollout worker "
              f"{sharded:.1f} s |")
        print(f"fsdp2_loop_overhead={sharded / local - 1:.3f}")
        return
    if a.smoke:
        s = bench_sync(tiny_model_folder(), smoke, reps=(1, 1))
    else:
        s = bench_sync(str(resolve_model_path(SMOLLM2_ALIAS)))
    gb = s["full_bytes"] / 1e9
    print("| sync | bytes | Ray object store s | gloo broadcast s | in-process s | object store GB/s | broadcast GB/s |")
    print("|---|---|---|---|---|---|---|")
    print(f"| full weights | {s['full_bytes']:.0f} | {s['ray_full_s']:.3f} | {s['coll_full_s']:.3f} | "
          f"{s['local_full_s']:.3f} | {gb / s['ray_full_s']:.2f} | {gb / s['coll_full_s']:.2f} |")
    print(f"| LoRA adapter | {s['lora_bytes']:.0f} | {s['ray_lora_s'] * 1e3:.1f} ms | {s['coll_lora_s'] * 1e3:.1f} ms | "
          f"{s['local_lora_s'] * 1e3:.1f} ms | | |")
    line = (f"sync_gb_s={gb / s['ray_full_s']:.3f} lora_sync_ms={s['ray_lora_s'] * 1e3:.1f} "
            f"broadcast_gb_s={gb / s['coll_full_s']:.3f} broadcast_lora_ms={s['coll_lora_s'] * 1e3:.1f}")
    if not a.skip_iteration:
        with tempfile.TemporaryDirectory() as tmp:
            progress("default iteration in one process")
            local = one_iteration(False, Path(tmp) / "local", smoke)
            progress("default iteration with a Ray rollout worker")
            on_ray = one_iteration(True, Path(tmp) / "ray", smoke)
        print(f"| iteration 2 of the default | in-process {local:.1f} s | Ray 1+1 {on_ray:.1f} s |")
        line += f" ray_overhead={on_ray / local - 1:.3f}"
    ratio = None if a.smoke else fsdp_ratio()  # a smoke run leaves 4 to bench/fsdp_step.py --smoke
    if ratio is not None:
        line += f" fsdp2_step_ratio={ratio:.3f}"
    print(line)


if __name__ == "__main__":
    main()
