"""The trained policy: a causal LM (LoRA via PEFT, or full weights), its reference, its weights.

    policy = Policy.from_config(cfg.model, need_reference=cfg.algorithm.kl_beta > 0)
    logp, entropy = policy.row_logprobs(row)          # packed row -> per completion-token values
    policy.sync_state()                                # full merged weights, base HF names (sleuth.sync)
    policy.save(dir); policy.load_weights(dir); policy.export_merged(dir)

The reference policy for the KL term is the same model with the adapter disabled (LoRA, no second
copy) or a frozen copy of the initial weights (full fine-tuning, built only when needed).
Logprobs are computed from hidden states of the completion-predicting positions only, in chunks
(logprobs.py), so no [tokens, vocab] float32 tensor is ever kept.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from sleuth.config import ModelConfig
from sleuth.errors import UserError
from sleuth.models import check_lora_targets
from sleuth.train.attention import attention_kwargs, backend_for
from sleuth.train.logprobs import token_logprobs
from sleuth.train.packing import PackedRow

ADAPTER = "default"


class RowLogprobs(torch.nn.Module):
    """The trainer's forward as one module: the LM body, then chunked logprobs at chosen positions.

    Body and head in one module call (rather than `lm.model(...)` and a separate use of the head
    weight) lets FSDP2 shard this module as the root: its forward hooks gather the embeddings,
    final norm and lm_head that sit outside the decoder layers.
    """

    def __init__(self, lm: Any) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor, predictor_index: torch.Tensor, target_ids: torch.Tensor,
                **model_kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.lm.model(input_ids=input_ids, use_cache=False, **model_kwargs)
        hidden = out.last_hidden_state[0].index_select(0, predictor_index)
        return token_logprobs(hidden, self.lm.get_output_embeddings(), target_ids)


class Policy:
    """A causal LM being trained, with its tokenizer and (optionally) its reference."""

    def __init__(self, model: Any, tokenizer: Any, model_cfg: ModelConfig, need_reference: bool,
                 device: torch.device | str | None = None) -> None:
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.tokenizer = tokenizer
        self.model_cfg = model_cfg
        model.to(self.device)
        model.config.use_cache = False
        self._reference_model: Any = None
        if model_cfg.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if model_cfg.lora.enabled:
            from peft import LoraConfig as PeftLoraConfig
            from peft import get_peft_model

            lora = model_cfg.lora
            check_lora_targets(model, lora.target_modules)
            peft_cfg = PeftLoraConfig(
                r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                target_modules=lora.target_modules, task_type="CAUSAL_LM",
            )
            model = get_peft_model(model, peft_cfg, autocast_adapter_dtype=lora.dtype == "float32")
        else:
            if need_reference:
                self._reference_model = copy.deepcopy(model).eval().requires_grad_(False)
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
        from sleuth.models import load_causal_lm, load_tokenizer

        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        model = load_causal_lm(model_cfg.path, model_cfg.dtype, attn_implementation=backend_for(dev))
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

    def _row_forward(self, row_model: RowLogprobs, row: PackedRow) -> tuple[torch.Tensor, torch.Tensor]:
        dev = self.device
        return row_model(
            row.input_ids.to(dev)[None], row.predictor_index.to(dev), row.target_ids.to(dev),
            position_ids=row.position_ids.to(dev)[None], **attention_kwargs(row, self.attn_backend, dev),
        )

    def row_logprobs(self, row: PackedRow) -> tuple[torch.Tensor, torch.Tensor]:
        """(logprob [N] with grad, entropy [N]) of every completion token of a packed row."""
        return self._row_forward(self.row_model, row)

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
        """Completion logprobs from one plain causal forward of [prompt | completion] (self-check)."""
        ids = torch.tensor([prompt_ids + completion_ids], device=self.device)
        p = len(prompt_ids)
        predictors = torch.arange(p - 1, p - 1 + len(completion_ids), device=self.device)
        targets = torch.tensor(completion_ids, device=self.device)
        return self.row_model(ids, predictors, targets)[0]

    # ------------------------------------------------------------------ weights

    @torch.no_grad()
    def sync_state(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor) of the full weights, LoRA merged in (the adapter itself untouched)."""
        lm = self.causal_lm
        if not self.is_lora:
            for name, p in lm.named_parameters():
                yield name, p.detach()
            return
        from peft.tuners.lora import LoraLayer

        lora_modules = {name: m for name, m in lm.named_modules() if isinstance(m, LoraLayer)}
        for name, p in lm.named_parameters():
            if ".lora_" in name:
                continue
            if ".base_layer." not in name:
                yield name, p.detach()
                continue
            module_name, _, leaf = name.partition(".base_layer.")
            module = lora_modules[module_name]
            if leaf == "weight" and not module.merged and ADAPTER in module.lora_A:
                delta = module.get_delta_weight(ADAPTER)
                yield f"{module_name}.weight", (p.float() + delta.float()).to(p.dtype)
            else:
                yield f"{module_name}.{leaf}", p.detach()

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

        from sleuth.train.fsdp import is_sharded_checkpoint, load_checkpoint

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
        """A plain HF model folder with the merged weights, loadable by transformers and vLLM."""
        from safetensors.torch import save_file

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        state = {name: t.detach().to("cpu").contiguous() for name, t in self.sync_state()}
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
        lm = self.causal_lm
        config = copy.deepcopy(lm.config)
        config.use_cache = True
        config.save_pretrained(out)
        if getattr(lm, "generation_config", None) is not None:
            lm.generation_config.save_pretrained(out)
        self.tokenizer.save_pretrained(out)
        return out
