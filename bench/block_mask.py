"""BlockMask construction for a packed row: create_block_mask (mask function on every pair) vs
the layout-built mask (block_mask.py), side by side in one run.

    python bench/block_mask.py [--device cuda] [--reps 5] [--smoke]

Rows of 16k tokens in the Temporal Clue shape (1,000-token prompts, 8 completions of 200 each)
and the AIME shape (150-token prompts, 8 completions of 1,000). Reports the best of --reps after
one untimed build, and checks both masks are the same block for block. --smoke: 8k-token rows (the
shortest the AIME shape fits in), one timed build.
Last line: `name=value` pairs.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial

import torch
from torch.nn.attention.flex_attention import create_block_mask

from _smoke import add_smoke_flag
from sleuth.records import Completion, Group, Problem
from sleuth.system.hardware import cpu_description
from sleuth.train.kernels.block_mask import layout_block_mask
from sleuth.train.kernels.packed_attention import packed_mask_mod
from sleuth.train.packing import pack_groups

SHAPES = {"clue": (1000, 200), "aime": (150, 1000)}


def row(prompt: int, completion: int, tokens: int, device: torch.device) -> torch.Tensor:
    """scope_end of a packed row of `tokens` tokens: as many groups of 8 completions as fit, then padding."""
    groups: list[Group] = []
    while (len(groups) + 1) * (prompt + 8 * completion) <= tokens:
        g = len(groups)
        ids = [g + 1] * prompt
        comps = [Completion(ids, [1000 + 8 * g + i] * completion, [0.0] * completion, "length", "") for i in range(8)]
        groups.append(Group(Problem(f"g{g}", [], None), ids, comps, [0.0] * 8))
    (packed,) = pack_groups(groups, tokens, pad_to_multiple=tokens).rows
    return packed.scope_end.to(device)


def best_of(fn: Callable[[], object], reps: int, device: torch.device) -> tuple[float, object]:
    out = fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t)
    return min(times), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--reps", type=int, default=5)
    add_smoke_flag(ap)
    a = ap.parse_args()
    if a.smoke:
        a.tokens, a.reps = 8192, 1
    dev = torch.device(a.device)
    print(f"# cpu: {cpu_description()}", flush=True)
    print(f"# device {dev}, {a.tokens}-token rows, torch {torch.__version__}")
    print("| shape | create_block_mask ms | layout ms | speedup | same blocks |")
    print("|---|---|---|---|---|")
    heads = {}
    for name, (p, c) in SHAPES.items():
        scope_end = row(p, c, a.tokens, dev)
        mm = packed_mask_mod(scope_end)
        t_ref, ref = best_of(partial(create_block_mask, mm, None, None, a.tokens, a.tokens, device=dev), a.reps, dev)
        t_ours, ours = best_of(partial(layout_block_mask, scope_end, mm), a.reps, dev)
        same = torch.equal(ref.to_dense(), ours.to_dense()) and torch.equal(ref.full_kv_num_blocks,
                                                                             ours.full_kv_num_blocks)
        print(f"| {name} | {t_ref * 1e3:.2f} | {t_ours * 1e3:.2f} | {t_ref / t_ours:.1f}x | {same} |", flush=True)
        heads[f"{name}_ref_ms"], heads[f"{name}_layout_ms"] = t_ref * 1e3, t_ours * 1e3
        heads[f"{name}_speedup"] = t_ref / t_ours
    print(" ".join(f"{k}={v:.4g}" for k, v in heads.items()))


if __name__ == "__main__":
    main()
