"""BlockMask construction for a packed row: create_block_mask (mask function on every pair) vs
the layout-built mask (block_mask.py), side by side in one run.

    python bench/block_mask.py [--device cuda] [--reps 5]

Rows of 16k tokens in the Temporal Clue shape (1,000-token prompts, 8 completions of 200 each)
and the AIME shape (150-token prompts, 8 completions of 1,000). Reports the best of --reps after
one untimed build, and checks both masks are the same block for block.
Last line: `name=value` pairs.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial

import torch
from torch.nn.attention.flex_attention import create_block_mask

from sleuth.hardware import cpu_description
from sleuth.train.attention import packed_mask_mod
from sleuth.train.block_mask import layout_block_mask

SHAPES = {"clue": (1000, 200), "aime": (150, 1000)}


def row(prompt: int, completion: int, tokens: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    seg: list[int] = []
    comp: list[int] = []
    c, g = 1, 0
    while len(seg) + prompt + 8 * completion <= tokens:
        seg += [g] * (prompt + 8 * completion)
        comp += [0] * prompt
        for _ in range(8):
            comp += [c] * completion
            c += 1
        g += 1
    pad = tokens - len(seg)
    return torch.tensor(seg + [-1] * pad, device=device), torch.tensor(comp + [0] * pad, device=device)


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
    a = ap.parse_args()
    dev = torch.device(a.device)
    print(f"# cpu: {cpu_description()}", flush=True)
    print(f"# device {dev}, {a.tokens}-token rows, torch {torch.__version__}")
    print("| shape | create_block_mask ms | layout ms | speedup | same blocks |")
    print("|---|---|---|---|---|")
    heads = {}
    for name, (p, c) in SHAPES.items():
        seg, comp = row(p, c, a.tokens, dev)
        mm = packed_mask_mod(seg, comp)
        t_ref, ref = best_of(partial(create_block_mask, mm, None, None, a.tokens, a.tokens, device=dev), a.reps, dev)
        t_ours, ours = best_of(partial(layout_block_mask, seg, comp, mm), a.reps, dev)
        same = torch.equal(ref.to_dense(), ours.to_dense()) and torch.equal(ref.full_kv_num_blocks,
                                                                             ours.full_kv_num_blocks)
        print(f"| {name} | {t_ref * 1e3:.2f} | {t_ours * 1e3:.2f} | {t_ref / t_ours:.1f}x | {same} |", flush=True)
        heads[f"{name}_ref_ms"], heads[f"{name}_layout_ms"] = t_ref * 1e3, t_ours * 1e3
        heads[f"{name}_speedup"] = t_ref / t_ours
    print(" ".join(f"{k}={v:.4g}" for k, v in heads.items()))


if __name__ == "__main__":
    main()
