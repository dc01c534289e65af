"""Generation speed of the transformers engine: growing-cache decoding vs CUDA-graph decode steps.

    python bench/gpu_generate.py [--device cuda] [--quick | --smoke]

Two random-init bf16 models built in the script (nothing to download):
- the issue's shape: a ~0.2B byte-level model (hidden 1024, 16 layers), 8 prompts x 8 samples x
  200 new tokens, ~1,000-token prompts, decoded with rollout.hf_decode=dynamic and =cuda_graphs
  (on a CPU, =static: the same fixed-shape steps without capture);
- the 0.6B model of bench/gpu_train_step.py at 8, 64 and 256 concurrent sequences (prompts x 8),
  graphs only, with the decode step time against the memory-bandwidth bound (weight bytes / 4.3 TB/s,
  the H200's HBM3e; KV reads not counted).
Each setting runs once untimed first (kernels, captures, allocator), then timed. Tokens/s counts
generated tokens over wall time (prefill included). `--quick` (or `--smoke`) shrinks everything for a
CPU dry run.
Last line: `name=value` pairs.
"""

from __future__ import annotations

import argparse
import time

import torch

from _smoke import add_smoke_flag
from sleuth.records import SamplingParams
from sleuth.rollout.base import GenerationRequest
from sleuth.rollout.hf_engine import HFEngine
from sleuth.system.attention import PACKED, register_packed_attention
from sleuth.system.hardware import cpu_description, cpu_dtype
from sleuth.testing.tiny_model import build_model, build_tokenizer

HBM_BYTES_PER_S = 4.3e12


def make_model(hidden: int, layers: int, heads: int, kv_heads: int, vocab: int, dtype: torch.dtype,
               device: torch.device):  # -> a transformers causal LM
    model = build_model(hidden, layers, heads, kv_heads, seed=0, vocab_size=vocab, max_positions=4096)
    with torch.no_grad():  # keep logits sane at depth (the tiny-model init is meant for 2 layers)
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.02)
    register_packed_attention()
    model.set_attn_implementation(PACKED)
    return model.to(device=device, dtype=dtype).eval()


def requests(prompts: int, n: int, prompt_len: int, max_tokens: int, vocab: int) -> list[GenerationRequest]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(prompts):
        ids = torch.randint(0, min(vocab, 256), (prompt_len,), generator=g).tolist()  # no special ids
        out.append(GenerationRequest(ids, n, SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=i), f"p{i}"))
    return out


def timed(engine: HFEngine, reqs: list[GenerationRequest], device: torch.device) -> tuple[float, int, int]:
    """(seconds, generated tokens, longest sample) of one run after an untimed one."""
    engine.generate_all(reqs)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t = time.perf_counter()
    results = engine.generate_all(reqs)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dt = time.perf_counter() - t
    lengths = [len(s.token_ids) for r in results for s in r.samples]
    return dt, sum(lengths), max(lengths)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, for a CPU dry run of the script")
    add_smoke_flag(ap)
    a = ap.parse_args()
    a.quick = a.quick or a.smoke  # --smoke is --quick: the tiny model's sizes
    dev = torch.device(a.device)
    on_cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if on_cuda else getattr(torch, cpu_dtype())
    graphs = "cuda_graphs" if on_cuda else "static"
    q = a.quick
    small = dict(hidden=64 if q else 1024, layers=2 if q else 16, heads=4 if q else 16, kv_heads=2 if q else 8,
                 vocab=272)
    big = dict(hidden=64 if q else 1536, layers=2 if q else 24, heads=4 if q else 12, kv_heads=2 if q else 4,
               vocab=1000 if q else 32000)
    prompt_len, new = (60, 16) if q else (1000, 200)
    name = torch.cuda.get_device_name(dev) if on_cuda else "cpu"
    print(f"# cpu: {cpu_description()}", flush=True)
    print(f"# device {dev} ({name}), {dtype}, torch {torch.__version__}", flush=True)
    print("| model | rows | decode | tokens | s | tokens/s | step ms | bound ms |")
    print("|---|---|---|---|---|---|---|---|")
    heads: dict[str, float] = {}
    for label, shape, row_counts, modes in (("0.2B", small, [64], ["dynamic", graphs]),
                                            ("0.6B", big, [8, 64, 256], [graphs])):
        model = make_model(**shape, dtype=dtype, device=dev)
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        bound_ms = weight_bytes / HBM_BYTES_PER_S * 1e3
        for rows in row_counts:
            reqs = requests(max(rows // 8, 1), min(rows, 8), prompt_len, new, shape["vocab"])
            for mode in modes:
                engine = HFEngine(model, build_tokenizer(), max_rows=rows, decode=mode,
                                  context_len=prompt_len + new + 8)
                dt, tokens, longest = timed(engine, reqs, dev)
                engine.close()
                step_ms = dt / max(longest, 1) * 1e3
                print(f"| {label} | {rows} | {mode} | {tokens} | {dt:.2f} | {tokens / dt:.0f} | {step_ms:.2f} | "
                      f"{bound_ms:.3f} |", flush=True)
                key = f"{label.replace('.', '_')}_{rows}_{mode}"
                heads[f"tps_{key}"] = tokens / dt
                if label == "0.6B":
                    heads[f"step_ms_{rows}"] = step_ms
        del model
        if on_cuda:
            torch.cuda.empty_cache()
        if label == "0.6B":
            heads["bound_ms_0_6B"] = bound_ms
    dyn, fast = heads.get("tps_0_2B_64_dynamic"), heads.get(f"tps_0_2B_64_{graphs}")
    if dyn and fast:
        heads["gen_speedup"] = fast / dyn
    print(" ".join(f"{k}={v:.4g}" for k, v in heads.items()))


if __name__ == "__main__":
    main()
