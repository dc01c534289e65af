"""The trained policy: a causal LM (LoRA via PEFT, or full weights), its reference, its weights.

    policy = Policy.from_config(cfg.model, need_reference=cfg.algorithm.kl_beta > 0)
    logp, entropy = policy.row_logprobs(row)          # packed row -> per completion-token values
    policy.sync_state()                                # full merged weights, base HF names (sleuth.rollout.sync)
    policy.lora_adapter()                              # or the adapter alone (LoRA)
    policy.save(dir); policy.load_weights(dir); policy.export_merged(dir)

The reference policy for the KL term is the same model with the adapter disabled (LoRA, no second
copy) or a frozen copy of the initial weights (full fine-tuning, built only when needed).
Logprobs are computed from hidden states of the completion-predicting positions only, in chunks
(logprobs.py), so no [tokens, vocab] float32 tensor is ever kept.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from sleuth.config import ModelConfig
from sleuth.errors import UserError
from sleuth.records import LoraAdapter
from sleuth.system.models import (
    check_lora_targets,
    layer_linear_names,
    linears_with_own_forward,
    lora_layer_indices,
)
from sleuth.train.kernels.lora_inputs import keep_inputs_in_base_dtype
from sleuth.train.kernels.packed_attention import attention_kwargs, backend_for
from sleuth.train.kernels.recompute import recompute_cheap_activations
from sleuth.train.logprobs import token_logprobs
from sleuth.train.packing import PackedRow

ADAPTER = "default"
log = logging.getLogger(__name__)


class RowLogprobs(torch.nn.Module):
    """The trainer's forward as one module: the LM body, then chunked logprobs at chosen positions.

    Body and head in one module call (rather than `lm.model(...)` and a separate use of the head
    weight) lets FSDP2 shard this module as the root: its forward hooks gather the embeddings,
    final norm and lm_head that sit outside the decoder layers.
    """

    def __init__(self, lm: Any) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor, predictor_index: torch.Tensor | None = None,
                target_ids: torch.Tensor | None = None, token_bitmask: torch.Tensor | None = None,
                entropy_grad: bool = False, **model_kwargs: Any) -> Any:
        """(logprob, entropy) of `target_ids` predicted at `predictor_index` (under the grammar's
        `token_bitmask` when given: constrained decoding; the entropy differentiable with
        `entropy_grad`); without targets the model's own full forward and its logits (the
        self-check's reference)."""
        if target_ids is None or predictor_index is None:
            return self.lm(input_ids=input_ids, use_cache=False, **model_kwargs).logits
        out = self.lm.model(input_ids=input_ids, use_cache=False, **model_kwargs)
        hidden = out.last_hidden_state[0].index_select(0, predictor_index)
        return token_logprobs(hidden, self.lm.get_output_embeddings(), target_ids, token_bitmask=token_bitmask,
                              entropy_grad=entropy_grad)


class Policy:
    """A causal LM being trained, with its tokenizer and (optionally) its reference."""

    def __init__(self, model: Any, tokenizer: Any, model_cfg: ModelConfig, need_reference: bool,
                 device: torch.device | str | None = None) -> None:
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.tokenizer = tokenizer
        self.model_cfg = model_cfg
        if model_cfg.quantization != "none" and not model_cfg.lora.enabled:
            raise UserError(f"model.quantization={model_cfg.quantization} needs model.lora.enabled=true "
                            "(a quantized base is frozen; only an adapter can train on it)")
        if getattr(model, "hf_quantizer", None) is None:  # bitsandbytes models are placed at load
            model.to(self.device)
        model.config.use_cache = False
        self._reference_model: Any = None
        self._lora_by_param: dict[str, Any] | None = None
        if model_cfg.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if model_cfg.lora.enabled:
            from peft import LoraConfig as PeftLoraConfig
            from peft import get_peft_model

            lora = model_cfg.lora
            check_lora_targets(model, lora.target_modules)
            layers = lora_layer_indices(model, lora.last_layers)
            targets = layer_linear_names(model) if layers and lora.target_modules == "all-linear" else lora.target_modules
            peft_cfg = PeftLoraConfig(
                r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                target_modules=targets, task_type="CAUSAL_LM", layers_to_transform=layers,
                exclude_modules=linears_with_own_forward(model) or None,
            )
            model = get_peft_model(model, peft_cfg, autocast_adapter_dtype=lora.dtype == "float32")
            keep_inputs_in_base_dtype(model)  # no float32 copies of bf16 inputs kept for backward
            _note_unadapted(model, layers)
        else:
            if need_reference:
                self._reference_model = copy.deepcopy(model).eval().requires_grad_(False)
        if not model_cfg.gradient_checkpointing:  # which recomputes whole layers already
            recompute_cheap_activations(model)  # MLP activations, norms' float32 copies: rebuilt in backward
        self.model = model
        self.model.train()
        self.row_model = RowLogprobs(self.causal_lm)
        self.reference_row_model = None if self._reference_model is None else RowLogprobs(self._reference_model)
        self.compute_dtype: torch.dtype = self.causal_lm.dtype
        """The dtype matmuls run in (FSDP2 mixed precision keeps float32 parameters, computes in bf16)."""

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_config(cls, model_cfg: ModelConfig, need_reference: bool,
                    device: torch.device | str | None = None) -> Policy:
        """Load model_cfg.path; attention is sleuth_packed on CPU and flex_attention on CUDA."""
        from sleuth.system.models import load_tokenizer

        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        model = load_base_model(model_cfg, dev)
        if backend_for(dev, model.config) != model.config._attn_implementation:  # windows or sinks
            model.set_attn_implementation(backend_for(dev, model.config))
        tokenizer = load_tokenizer(model_cfg.path)
        return cls(model, tokenizer, model_cfg, need_reference, dev)

    @property
    def is_lora(self) -> bool:
        return self.model_cfg.lora.enabled

    @property
    def causal_lm(self) -> Any:
        """The transformers CausalLM (with LoRA layers injected when LoRA is on)."""
        return self.model.get_base_model() if self.is_lora else self.model

    @property
    def adapter_is_portable(self) -> bool:
        """Whether the adapter alone, applied to the unquantized base checkpoint, reproduces this
        policy: LoRA on linear layers only (not PEFT's fused-expert ParamWrappers, whose tensors
        are not B @ A of a weight) and no quantized base."""
        return (self.is_lora and self.model_cfg.quantization == "none"
                and not any(hasattr(m, "parameter_name") for m in self._lora_layers().values()))

    @property
    def has_reference(self) -> bool:
        """Whether reference() works: always with LoRA, with full weights only if built for it."""
        return self.is_lora or self._reference_model is not None

    @property
    def attn_backend(self) -> str:
        return str(self.causal_lm.config._attn_implementation)

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def matmul_parameters(self) -> tuple[int, int]:
        """(parameters of the body's linear layers, parameters of lm_head): for FLOP estimates."""
        lm = self.causal_lm
        head = lm.get_output_embeddings()
        head_ids = {id(p) for p in head.parameters()}
        body = sum(p.numel() for m in lm.modules() if isinstance(m, torch.nn.Linear)
                   for p in m.parameters(recurse=False) if id(p) not in head_ids)
        return body, sum(p.numel() for p in head.parameters())

    # ------------------------------------------------------------------ forward passes

    def _row_forward(self, row_model: RowLogprobs, row: PackedRow,
                     entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        dev = self.device
        return row_model(
            row.input_ids.to(dev)[None], row.predictor_index.to(dev), row.target_ids.to(dev),
            token_bitmask=None if row.token_bitmask is None else row.token_bitmask.to(dev),
            entropy_grad=entropy_grad, position_ids=row.position_ids.to(dev)[None], **attention_kwargs(row, self.attn_backend, dev),
        )

    def row_logprobs(self, row: PackedRow, entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(logprob [N] with grad, entropy [N], with grad too when `entropy_grad`) of every
        completion token of a packed row."""
        return self._row_forward(self.row_model, row, entropy_grad)

    @contextlib.contextmanager
    def reference(self) -> Iterator[Any]:
        """Yields the reference CausalLM: the adapter disabled (LoRA) or the frozen copy."""
        if self.is_lora:
            with self.model.disable_adapter():
                yield self.causal_lm
        elif self._reference_model is not None:
            yield self._reference_model
        else:
            raise RuntimeError("full fine-tuning policy built without a reference (need_reference=False)")

    @torch.no_grad()
    def reference_logprobs(self, row: PackedRow) -> torch.Tensor:
        if self.is_lora:
            with self.model.disable_adapter():
                return self._row_forward(self.row_model, row)[0]
        if self.reference_row_model is None:
            raise RuntimeError("full fine-tuning policy built without a reference (need_reference=False)")
        return self._row_forward(self.reference_row_model, row)[0]

    @torch.no_grad()
    def naive_logprobs(self, prompt_ids: list[int], completion_ids: list[int]) -> torch.Tensor:
        """Completion logprobs from one plain causal forward of [prompt | completion] (self-check):
        the model's own logits, so a head that is more than a linear layer (logit soft-capping or
        scaling, which row_logprobs does not apply) fails the self-check too."""
        ids = torch.tensor([prompt_ids + completion_ids], device=self.device)
        p, n = len(prompt_ids), len(completion_ids)
        logits = self.row_model(ids)[0, p - 1 : p - 1 + n].float()
        targets = torch.tensor(completion_ids, device=self.device)
        return torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0]

    @torch.no_grad()
    def greedy_probe(self, prompt_ids: list[int], n: int) -> tuple[list[int], torch.Tensor]:
        """The policy's greedy continuation of `prompt_ids` (n tokens) and the log-softmax [n, V]
        at each of its steps: the trainer's side of the weight-sync check (rollout/sync_check.py)."""
        ids, rows = list(prompt_ids), []
        for _ in range(n):
            logits = self.row_model(torch.tensor([ids], device=self.device))[0, -1].float()
            rows.append(torch.log_softmax(logits, -1).cpu())
            ids.append(int(rows[-1].argmax()))
        return ids[len(prompt_ids):], torch.stack(rows)

    # ------------------------------------------------------------------ weights

    @torch.no_grad()
    def sync_state(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor) of the full weights, LoRA merged in (the adapter itself untouched).

        A LoRA layer on a linear module adapts its `weight`; PEFT's ParamWrapper (fused MoE expert
        stacks, nested one per adapted parameter) adapts the parameter it names. Either way the
        HF name is the parameter's name with PEFT's `.base_layer` hops removed."""
        lm = self.causal_lm
        yield from self._quantized_tables()
        yield from self._saved_buffers()
        if not self.is_lora:
            for name, p in lm.named_parameters():
                yield name, p.detach()
            return
        for name, p in lm.named_parameters():
            if ".lora_" in name:
                continue
            hf_name = name.replace(".base_layer", "")
            layer = self._lora_layers().get(hf_name)
            value = self._dequantized(name, p)
            if layer is not None and not layer.merged and ADAPTER in layer.lora_A:
                yield hf_name, (value.float() + layer.get_delta_weight(ADAPTER).float()).to(value.dtype)
            else:
                yield hf_name, value

    @torch.no_grad()
    def lora_adapter(self) -> LoraAdapter:
        """The LoRA adapter as tensors (no copy, no disk): PEFT names without the adapter name."""
        from peft import get_peft_model_state_dict

        lora = self.model_cfg.lora
        tensors = {name: t.detach() for name, t in get_peft_model_state_dict(self.model).items()}
        targets = tuple(lora.target_modules) if isinstance(lora.target_modules, list) else ()
        return LoraAdapter(tensors, rank=lora.rank, alpha=lora.alpha, target_modules=targets)

    def _saved_buffers(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor) of the persistent buffers a checkpoint holds besides parameters
        (DeepSeek V3's router score-correction bias, Gemma 4's per-layer scalars): those of the
        model's own modules, not a quantized layer's codes and scales (sent dequantized)."""
        # Persistence read off each module (not from state_dict(), whose FSDP2 hooks would turn the
        # gathered parameters back into shards).
        for module_name, module in self.causal_lm.named_modules():
            if not type(module).__module__.startswith("transformers."):
                continue
            for name, b in module.named_buffers(recurse=False):
                if b is not None and name not in module._non_persistent_buffers_set:
                    full = f"{module_name}.{name}" if module_name else name
                    yield full.replace(".base_layer", ""), b.detach()

    def _quantized_tables(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, dequantized table) of a 4-bit token embedding (quantized_embedding.py), which
        holds buffers rather than a parameter."""
        if self.model_cfg.quantization != "nf4":  # the only mode that makes one (load_base_model)
            return
        from sleuth.train.kernels.quantized_embedding import NF4Embedding

        for name, m in self.causal_lm.named_modules():
            if isinstance(m, NF4Embedding):
                yield f"{name}.weight", m.dequantize()

    def _dequantized(self, name: str, p: torch.Tensor) -> torch.Tensor:
        """The parameter in the compute dtype: bitsandbytes 4/8-bit weights dequantized."""
        kind = type(p).__name__
        if kind not in ("Params4bit", "Int8Params"):
            return p.detach()
        dtype = _torch_dtype(self.model_cfg.dtype)
        if kind == "Params4bit":
            from bitsandbytes.functional import dequantize_4bit

            return dequantize_4bit(p.data, p.quant_state).to(dtype)
        # LLM.int8: row-wise absmax scaling, int8 value * row scale / 127. (PEFT's helper re-places
        # the module afterwards, which drops the scales of a CPU module.)
        scales = p.SCB if getattr(p, "SCB", None) is not None else self.causal_lm.get_submodule(
            name.rsplit(".", 1)[0]).state.SCB
        return (p.data.float() * scales.float()[:, None] / 127.0).to(dtype)

    def _lora_layers(self) -> dict[str, Any]:
        """HF parameter name -> the LoRA layer adapting it (cached; the module tree never changes)."""
        if self._lora_by_param is None:
            from peft.tuners.lora import LoraLayer

            found = {}
            for name, m in self.causal_lm.named_modules():
                if isinstance(m, LoraLayer):
                    leaf = getattr(m, "parameter_name", None) or "weight"
                    found[f"{name.replace('.base_layer', '')}.{leaf}"] = m
            self._lora_by_param = found
        return self._lora_by_param

    def save(self, out_dir: str | Path) -> Path:
        """Adapter (LoRA: adapter_config.json + adapter_model.safetensors) or full HF weights."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(out)
        self.tokenizer.save_pretrained(out)
        return out

    @torch.no_grad()
    def load_weights(self, in_dir: str | Path) -> None:
        """Load what save() wrote into this policy (same base model and LoRA settings).

        A sharded checkpoint of FSDP2 ranks (train/fsdp.py) loads too, on any number of processes.
        """
        from safetensors.torch import load_file

        from sleuth.train.sharded import is_sharded_checkpoint, load_checkpoint

        src = Path(in_dir)
        if is_sharded_checkpoint(src):
            load_checkpoint(src, self)
            return
        if self.is_lora:
            from peft import set_peft_model_state_dict

            f = src / "adapter_model.safetensors"
            if not f.is_file():
                raise UserError(f"{src} has no adapter_model.safetensors (was it saved with LoRA?)")
            result = set_peft_model_state_dict(self.model, load_file(f, device=str(self.device)))
            if getattr(result, "unexpected_keys", None):
                raise UserError(f"adapter in {src} does not match the model: {result.unexpected_keys[:3]}")
            return
        files = sorted(src.glob("*.safetensors"))
        if not files:
            raise UserError(f"{src} has no *.safetensors weights")
        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(load_file(f, device=str(self.device)))
        missing, unexpected = self.causal_lm.load_state_dict(state, strict=False)
        tied = {"lm_head.weight"} if self.causal_lm.config.tie_word_embeddings else set()
        if unexpected or set(missing) - tied:
            raise UserError(f"weights in {src} do not match the model (missing {missing[:3]}, "
                            f"unexpected {unexpected[:3]})")

    def export_merged(self, out_dir: str | Path) -> Path:
        """A plain HF model folder with the merged weights, loadable by transformers and vLLM (in
        the original's layout when trained out of a multimodal checkpoint, wrapped_export.py)."""
        from safetensors.torch import save_file

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        state = _checkpoint_format(self.causal_lm, {name: t.detach().to("cpu").contiguous()
                                                    for name, t in self.sync_state()})
        from sleuth.train.wrapped_export import wrapped_source, write_wrapped_export

        source = wrapped_source(self.model_cfg.path)
        if source is not None:  # trained out of a multimodal checkpoint: exported in its layout
            write_wrapped_export(out, source, state)
            self.tokenizer.save_pretrained(out)
            return out
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
        lm = self.causal_lm
        config = copy.deepcopy(lm.config)
        config.use_cache = True
        if hasattr(config, "quantization_config"):  # the export holds dequantized weights
            del config.quantization_config
        config.save_pretrained(out)
        if getattr(lm, "generation_config", None) is not None:
            lm.generation_config.save_pretrained(out)
        self.tokenizer.save_pretrained(out)
        return out


def _checkpoint_format(lm: Any, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The export's names and layout: the published checkpoints' (models.checkpoint_layout), as
    save_pretrained writes them."""
    from sleuth.system.models import checkpoint_layout

    return checkpoint_layout(lm, state)


def load_base_model(model_cfg: ModelConfig, device: torch.device) -> Any:
    """The CausalLM of model_cfg.path before LoRA: quantized at load by bitsandbytes for
    model.quantization, and with nf4 its token embedding in 4 bits too (quantized_embedding.py)."""
    from sleuth.system.models import load_causal_lm

    quant = quantization_config(model_cfg.quantization, model_cfg.dtype)
    extra = {"quantization_config": quant, "device_map": str(device)} if quant is not None else {}
    model = load_causal_lm(model_cfg.path, model_cfg.dtype, attn_implementation=backend_for(device), **extra)
    if model_cfg.quantization == "nf4":  # bitsandbytes leaves the (often tied) embedding in 16 bits
        from sleuth.train.kernels.quantized_embedding import quantize_embeddings

        quantize_embeddings(model, _torch_dtype(model_cfg.dtype))
        keep_4bit_layout(model)
    return model


def keep_4bit_layout(model: Any) -> None:
    """Keep bitsandbytes' 4-bit weights in their canonical layout on CPU.

    On a CPU with AVX512_BF16, bitsandbytes 0.50 repacks a Linear4bit's weight in place the first
    time it runs in eval mode without gradients, and from then on multiplies with an inference-only
    kernel: no gradient flows back through the layer (so the adapters below it stop learning), the
    numbers move (~1e-2 in the tiny model's logits), and the repacked codes no longer dequantize to
    the layer's weight (merged weights for sync and export were garbage). The policy runs such
    forwards (reference and old logprobs), so it turns the repacking off."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


def quantization_config(name: str, dtype: str) -> Any:
    """The transformers BitsAndBytesConfig for model.quantization (None for "none").

    bitsandbytes 0.50 runs 4-bit and 8-bit layers on CPU as well as CUDA (checked on the AVX2
    development CPU, docs/benchmarks.md). The 4-bit layers compute in the model's dtype."""
    if name == "none":
        return None
    if importlib.util.find_spec("bitsandbytes") is None:
        raise UserError(f"model.quantization={name} needs bitsandbytes: pip install 'sleuth[quant]'")
    import warnings

    from transformers import BitsAndBytesConfig

    # LLM.int8 on CPU warns on every forward that it casts inputs to float16.
    warnings.filterwarnings("ignore", message="MatMul8bitLt: inputs will be cast")
    if name == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    compute = _torch_dtype(dtype)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=compute)


def _torch_dtype(name: str) -> torch.dtype:
    """model.dtype as a torch dtype ("auto" resolved for this machine)."""
    from sleuth.system.hardware import resolve_dtype

    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[resolve_dtype(name)]


def _note_unadapted(model: Any, layers: list[int] | None = None) -> None:
    """Log the weight matrices of the (chosen) decoder layers that LoRA leaves frozen: those PEFT
    cannot wrap (GPT-OSS's fused experts and router are neither nn.Linear nor recognised expert
    stacks). Every adapted parameter sits under a `.base_layer.` (a LoRA linear or a ParamWrapper)."""
    def chosen(name: str) -> bool:
        index = re.search(r"\.layers\.(\d+)\.", name)
        return index is not None and (layers is None or int(index.group(1)) in layers)

    skipped = sorted({re.sub(r"\.\d+\.", ".N.", n) for n, p in model.named_parameters()
                      if p.dim() >= 2 and not p.requires_grad and chosen(n) and ".base_layer." not in n})
    if skipped:
        log.warning("LoRA leaves these weights frozen (PEFT cannot wrap them): %s", ", ".join(skipped))
