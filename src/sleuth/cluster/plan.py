"""The plan before a launch: where each worker runs and how much memory it will need.

    lines = plan_lines(cfg, nodes)      # what `sleuth train CONFIG --dry-run` prints

Estimates come from the model's config.json alone (no weights are loaded):

- trainer rank (FSDP2 over W ranks): parameters, gradients and AdamW's two moments sharded 1/W
  (gradients and moments only for what is trained: the LoRA adapter, or every weight), plus, while
  a layer runs, that layer gathered whole; a frozen reference copy when kl_beta > 0 without LoRA;
  activations of one packed row of trainer.row_tokens tokens (rows run one at a time) and the
  float32 logits of one 1,024-token chunk.
- rollout worker: the weights split over its tensor-parallel GPUs, plus the KV cache (vLLM on GPU:
  gpu_memory_utilization of the device minus the weights; on CPU rollout.kv_cache_gb; our
  transformers engine: the cache of its rows in flight).

A planned total above the device's memory (GPU memory, or a CPU node's RAM shared by the workers
on it) is flagged WARNING.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sleuth.cluster.runtime import Assignment, GiB, Node, place, worker_specs
from sleuth.config import Config
from sleuth.errors import UserError
from sleuth.system.hardware import resolve_dtype

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def dtype_bytes(cfg: Config) -> int:
    """Bytes per weight of model.dtype ("auto" as this machine resolves it)."""
    return DTYPE_BYTES[resolve_dtype(cfg.model.dtype)]


NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)
"""Bytes per weight of a bitsandbytes nf4 layer: 4 bits, an 8-bit scale per 64 weights, and a
float32 scale per 256 of those (double quantization)."""
NF4_TABLE_BYTES = 0.5 + 4 / 64
"""Bytes per value of the 4-bit token embedding (train/quantized_embedding.py)."""
LOGIT_CHUNK = 1024
"""train/logprobs.py computes float32 logits in chunks of this many tokens."""
ACTIVATION_FACTOR = 26
"""Saved activations per token per layer, in units of hidden_size values, besides the MLP's 4
intermediate-sized tensors (norm inputs, q/k/v, attention output, residuals, LoRA inputs, and the
allocator's slack): set from the measured peak of a SmolLM2 step on this CPU (16 from counting
tensors came out 18% under it; docs/benchmarks.md, "scale-out")."""


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    qkv_bias: bool

    @classmethod
    def from_folder(cls, folder: Path) -> ModelShape:
        try:
            c = json.loads((folder / "config.json").read_text())
        except (OSError, ValueError) as e:
            raise UserError(f"cannot read {folder / 'config.json'}: {e}") from None
        c = c.get("text_config", c)
        try:
            h, heads = int(c["hidden_size"]), int(c["num_attention_heads"])
            return cls(hidden=h, intermediate=int(c["intermediate_size"]), layers=int(c["num_hidden_layers"]),
                       heads=heads, kv_heads=int(c.get("num_key_value_heads") or heads),
                       head_dim=int(c.get("head_dim") or h // heads), vocab=int(c["vocab_size"]),
                       tied=bool(c.get("tie_word_embeddings", False)),
                       qkv_bias=bool(c.get("attention_bias", c.get("model_type") == "qwen2")))
        except KeyError as e:
            raise UserError(f"{folder / 'config.json'} lacks {e.args[0]}: cannot estimate memory") from None

    def linears(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each linear layer of one decoder layer."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        h, i = self.hidden, self.intermediate
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def layer_params(self) -> int:
        bias = (self.heads + 2 * self.kv_heads) * self.head_dim if self.qkv_bias else 0
        return sum(a * b for a, b in self.linears().values()) + bias + 2 * self.hidden

    def params(self) -> int:
        embed = self.vocab * self.hidden
        return embed * (1 if self.tied else 2) + self.layers * self.layer_params() + self.hidden

    def linear_params(self) -> int:
        """The decoder layers' linear weights (what bitsandbytes quantizes)."""
        return self.layers * sum(a * b for a, b in self.linears().values())

    def base_bytes(self, dtype_bytes: int, quantization: str) -> float:
        """Bytes of the frozen base as loaded: with nf4, linear weights at 4 bits plus bitsandbytes'
        double-quantized block scales (~0.52 bytes each) and the token embedding in our 4-bit table
        (4 bits + a float32 scale per 64: 0.5625 bytes); with int8, linear weights at 1 byte. Norms,
        biases and an untied output head stay in the model's dtype."""
        if quantization == "none":
            return self.params() * dtype_bytes
        linear = self.linear_params()
        embed = self.vocab * self.hidden
        rest = self.params() - linear - embed
        if quantization == "int8":
            return linear * 1.0 + (embed + rest) * dtype_bytes
        return linear * NF4_BYTES + embed * NF4_TABLE_BYTES + rest * dtype_bytes

    def lora_params(self, rank: int, targets: list[str] | str, last_layers: int | None = None) -> int:
        chosen = [(a, b) for name, (a, b) in self.linears().items() if targets == "all-linear" or name in targets]
        layers = self.layers if last_layers is None else min(last_layers, self.layers)
        return layers * sum(rank * (a + b) for a, b in chosen)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes


def trainer_memory(cfg: Config, shape: ModelShape, world: int) -> dict[str, float]:
    """GiB per trainer rank: params, grads, optimizer, activations (and total)."""
    b = dtype_bytes(cfg)
    lora = cfg.model.lora
    trained = shape.lora_params(lora.rank, lora.target_modules, lora.last_layers) if lora.enabled else shape.params()
    frozen_copy = shape.params() if cfg.algorithm.kl_beta > 0 and not lora.enabled else 0
    gathered = shape.layer_params() * b if world > 1 else 0  # one layer unsharded during its compute
    base = shape.base_bytes(b, cfg.model.quantization)
    params = (base + ((trained if lora.enabled else 0) + frozen_copy) * b) / world + gathered
    tokens = cfg.trainer.row_tokens
    per_token_layer = ACTIVATION_FACTOR * shape.hidden + 4 * shape.intermediate
    if cfg.model.gradient_checkpointing:  # layer inputs kept, one layer recomputed at a time
        act = tokens * b * (shape.layers * shape.hidden + per_token_layer)
    else:
        act = tokens * b * shape.layers * per_token_layer
    logits = min(tokens, LOGIT_CHUNK) * shape.vocab * 4 * 3  # logits, softmax, gradient
    out = {"params": params, "grads": trained * b / world, "optimizer": 2 * trained * b / world,
           "activations": act + logits}
    out = {k: v / GiB for k, v in out.items()}
    out["total"] = sum(out.values())
    return out


def rollout_memory(cfg: Config, shape: ModelShape, tp: int, device_gb: float | None, engine: str) -> dict[str, float]:
    """GiB per rollout worker, per GPU when it has several (tp): weights, KV cache, total; and the
    tokens the whole KV cache holds."""
    b = dtype_bytes(cfg)
    weights = shape.params() * b / max(tp, 1) / GiB
    if engine == "vllm" and tp > 0 and device_gb:
        kv = max(0.0, cfg.rollout.gpu_memory_utilization * device_gb - weights)
    elif engine == "vllm":
        kv = cfg.rollout.kv_cache_gb
    else:  # our engine: its rows in flight at full length, each group's prompt (<= 1,024 tokens) once
        rows = min(cfg.rollout.max_concurrency or 64, cfg.loop.tasks_per_iteration * cfg.rollout.samples_per_task)
        groups = -(-rows // cfg.rollout.samples_per_task)
        kv = (rows * cfg.rollout.max_tokens + groups * 1024) * shape.kv_bytes_per_token(b) / GiB
    tokens = kv * max(tp, 1) * GiB / shape.kv_bytes_per_token(b)  # tensor parallel splits the KV heads
    return {"weights": weights, "kv_cache": kv, "kv_tokens": tokens, "total": weights + kv}


def local_nodes() -> list[Node]:
    """This machine as the one node a local cluster would have (nothing started)."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB
    gpu_gb = torch.cuda.get_device_properties(0).total_memory / GiB if gpus else None
    return [Node("local", "this machine", float(os.cpu_count() or 1), float(gpus), mem, gpu_gb)]


def plan_lines(cfg: Config, nodes: list[Node], model_folder: Path, engine: str) -> list[str]:
    """The placement and the memory plan, one line per worker, WARNING lines where it will not fit."""
    shape = ModelShape.from_folder(model_folder)
    C = cfg.cluster
    placement = place(worker_specs(C, nodes), nodes)
    lines = [f"model: {shape.params() / 1e9:.2f}B parameters ({shape.layers} layers, hidden {shape.hidden}), "
             f"{resolve_dtype(cfg.model.dtype)}" + (f", LoRA rank {cfg.model.lora.rank}" if cfg.model.lora.enabled else "")
             + (f", {cfg.model.quantization} base" if cfg.model.quantization != "none" else "")]
    world = C.trainer_workers
    trainer_on: list[tuple[str, Node | None, float]] = []
    if world == 1:
        on_gpu = bool(nodes and nodes[0].gpus)
        trainer_on.append(("trainer (driver process)", nodes[0] if nodes else None, 1.0 if on_gpu else 0.0))
    trainer_on += [(a.spec.name, a.node, a.spec.gpus) for a in placement if a.spec.kind == "trainer"]
    t = trainer_memory(cfg, shape, world)
    use: dict[str, float] = {}
    for name, node, gpus in trainer_on:
        lines.append(_worker_line(name, node, gpus, placement) + f": params {t['params']:.2f} + grads "
                     f"{t['grads']:.2f} + optimizer {t['optimizer']:.2f} + activations {t['activations']:.2f} "
                     f"= {t['total']:.2f} GiB" + _fits(t["total"], node, gpus, use))
    for a in placement:
        if a.spec.kind != "rollout":
            continue
        r = rollout_memory(cfg, shape, int(a.spec.gpus), a.node.gpu_memory_gb, engine)
        name = a.spec.name if C.uses_ray else "rollout engine (driver process)"
        per = " per GPU" if a.spec.gpus > 1 else ""
        lines.append(_worker_line(name, a.node, a.spec.gpus, placement) + f": weights {r['weights']:.2f} "
                     f"+ KV cache {r['kv_cache']:.2f} (~{r['kv_tokens']:,.0f} tokens) = {r['total']:.2f} GiB{per}"
                     + _fits(r["total"], a.node, a.spec.gpus, use)
                     + ("  WARNING: no room left for the KV cache (more GPUs per worker, or a higher "
                        "rollout.gpu_memory_utilization)" if r["kv_tokens"] < cfg.rollout.max_tokens else ""))
    lines += _cpu_node_warnings(nodes, use)
    return lines


def _worker_line(name: str, node: Node | None, gpus: float, placement: list[Assignment]) -> str:
    where = "no node" if node is None else f"node {node.ip}"
    slots = next((a.gpu_slots for a in placement if name.startswith(a.spec.name)), ())
    device = f"GPU {','.join(map(str, slots))}" if gpus and slots else ("GPU" if gpus else "CPU")
    return f"{name} on {where} {device}"


def _fits(total: float, node: Node | None, gpus: float, use: dict[str, float]) -> str:
    if node is None:
        return ""
    if gpus:
        if node.gpu_memory_gb is None:
            return " (GPU memory unknown)"
        have = node.gpu_memory_gb  # totals are per GPU
        return "" if total <= have else f"  WARNING: exceeds the {have:.0f} GiB of a GPU"
    use[node.node_id] = use.get(node.node_id, 0.0) + total
    return ""


def _cpu_node_warnings(nodes: list[Node], use: dict[str, float]) -> list[str]:
    return [f"WARNING: the CPU workers on node {n.ip} need {use[n.node_id]:.2f} GiB, more than its "
            f"{n.memory_gb:.1f} GiB of memory" for n in nodes if use.get(n.node_id, 0.0) > n.memory_gb]


def cluster_nodes(cfg: Config) -> list[Node]:
    """The nodes to plan on: the cluster at cluster.address (joined and left again), else this machine."""
    if cfg.cluster.address is None:
        return local_nodes()
    from sleuth.cluster.runtime import connect

    cluster = connect(cfg.cluster)
    try:
        return cluster.nodes
    finally:
        cluster.shutdown()


def describe(cfg: Config, engine: str, model_folder: Any, nodes: list[Node] | None = None) -> list[str]:
    """What --dry-run prints for the cluster section (nodes: a described cluster, else the real one)."""
    return plan_lines(cfg, nodes if nodes is not None else cluster_nodes(cfg), Path(model_folder), engine)


def main(argv: list[str] | None = None) -> int:
    """`python -m sleuth.cluster.plan CONFIG [k=v ...] --nodes N --gpus-per-node G --gpu-memory-gb M`:
    the --dry-run plan for a described cluster (to size one before it exists)."""
    import argparse

    from sleuth.config import load_config
    from sleuth.rollout.factory import vllm_available
    from sleuth.system.models import resolve_model_path

    p = argparse.ArgumentParser(prog="python -m sleuth.cluster.plan", description=main.__doc__)
    p.add_argument("args", nargs="*", metavar="CONFIG.yaml | key=value")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--gpu-memory-gb", type=float, default=80.0)
    p.add_argument("--cpus-per-node", type=float, default=64.0)
    p.add_argument("--memory-gb", type=float, default=1024.0)
    a = p.parse_args(argv)
    paths = [x for x in a.args if "=" not in x]
    cfg = load_config(paths[0] if paths else None, [x for x in a.args if "=" in x])
    nodes = [Node(f"n{k}", f"node{k}", a.cpus_per_node, float(a.gpus_per_node), a.memory_gb,
                  a.gpu_memory_gb if a.gpus_per_node else None) for k in range(a.nodes)]
    engine = cfg.rollout.engine if cfg.rollout.engine != "auto" else ("vllm" if vllm_available() else "hf")
    try:
        for line in describe(cfg, engine, resolve_model_path(cfg.model.path), nodes):
            print(line)
    except UserError as e:
        print(f"sleuth: error: {e}")
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
