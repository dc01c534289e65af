"""What loop.deterministic's MKL setting costs: the default's training step with and without it.

    .venv/bin/python bench/reproducible_math.py [--dtypes float32,bfloat16] [--reps 2] [--smoke]

loop.deterministic sets MKL_CBWR=COMPATIBLE (system.hardware.reproducible_cpu_math): Intel MKL then runs its
reproducible, portable code path, so processes agree to the last bit. MKL reads the setting at its
first call, so each setting runs in a fresh process of this script, one after the other: a float32
1024^3 matmul (MKL's sgemm) and the embedded default's training step (SmolLM2-135M, LoRA rank 16 on
the last 15 layers, 4 groups of 8 completions, prompt 830 + completion 40 tokens, one optimizer
step per group), best of --reps steps after a warm-up. bf16 matmuls go through oneDNN, not MKL.
Last line: `step_slowdown=…` (with / without, the first dtype). --smoke: a 256^3 matmul and the tiny
model's step (LoRA on its last layer, prompts of a tenth), one timed step.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from _smoke import add_smoke_flag

SETTINGS = {"default": None, "COMPATIBLE": "COMPATIBLE"}
"""MKL_CBWR per column: unset (MKL picks its code path per call) and what loop.deterministic sets."""


def child(dtypes: list[str], reps: int, smoke: bool = False) -> dict[str, float]:
    """Timings in this process (MKL_CBWR as the parent set it)."""
    import torch

    from _smoke import tiny_model_folder
    from lora_layers import PROMPT, time_steps

    n = 256 if smoke else 1024
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    start = time.perf_counter()
    for _ in range(5):
        a @ b
    out = {"matmul_gflops": 5 * 2 * n**3 / (time.perf_counter() - start) / 1e9}
    for dtype in dtypes:  # the default's step (lora_layers.py): LoRA on the last 15 layers
        if smoke:  # the tiny model has 2 layers
            out[f"step_{dtype}_s"] = time_steps(1, reps, dtype, tiny_model_folder(), PROMPT // 10)[0]
        else:
            out[f"step_{dtype}_s"] = time_steps(15, reps, dtype)[0]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated model dtypes for the step")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    add_smoke_flag(ap)
    args = ap.parse_args()
    if args.smoke:
        args.reps = 1
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if not dtypes or any(d not in ("float32", "bfloat16") for d in dtypes):
        ap.error(f"--dtypes {args.dtypes!r}: expected float32 and/or bfloat16, comma-separated")
    if args.reps < 1:
        ap.error("--reps must be at least 1")
    if args.child:
        print(json.dumps(child(dtypes, args.reps, args.smoke)))
        return
    from sleuth.system.hardware import cpu_description

    print(f"# cpu: {cpu_description()}")
    print(f"# each MKL_CBWR setting in its own process, one after the other; step: best of {args.reps}")
    results = {}
    for name, value in SETTINGS.items():
        env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"} | ({"MKL_CBWR": value} if value else {})
        env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.dirname(__file__), env.get("PYTHONPATH")) if p)
        done = subprocess.run([sys.executable, __file__, "--child", "--dtypes", args.dtypes, "--reps", str(args.reps),
                               *(["--smoke"] if args.smoke else [])], env=env, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"reproducible_math: the MKL_CBWR={value} process failed: {done.stderr.strip()[-2000:]}")
        results[name] = json.loads(done.stdout.strip().splitlines()[-1])
    keys = list(results["default"])
    print(f"{'MKL_CBWR':>10} " + " ".join(f"{k:>16}" for k in keys))
    for name, row in results.items():
        print(f"{name:>10} " + " ".join(f"{row[k]:>16.2f}" for k in keys))
    first = f"step_{dtypes[0]}_s"
    print(f"step_slowdown={results['COMPATIBLE'][first] / results['default'][first]:.2f}")


if __name__ == "__main__":
    main()
