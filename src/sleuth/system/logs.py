"""What a user sees on stderr: sleuth's own progress bars and one line per iteration. The engines'
INFO logs and the warnings known to be benign here are left out unless asked for (`--verbose` or
SLEUTH_LOG=debug); every other warning (a real load failure, a fallback) still shows.

    configure_logging(verbose=False)   # the CLI's first step; child processes read SLEUTH_LOG
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable

ENV = "SLEUTH_LOG"
"""`debug`: everything the libraries log; anything else (or unset): quiet."""

Args = tuple[object, ...]


def _always(_args: Args) -> bool:
    return True


def _layer_without_weights(args: Args) -> bool:
    return bool(args) and args[0] in ("RotaryEmbedding", "ParallelLMHead", "VocabParallelEmbedding")


def _narrowed_to_run_dtype(args: Args) -> bool:
    return len(args) == 3 and str(args[1]) == "torch.float32" and str(args[2]) in ("torch.bfloat16", "torch.float16")


def _own_dist_ident(args: Args) -> bool:
    return args == ("VLLM_DIST_IDENT",)


BENIGN: tuple[tuple[str, str, Callable[[Args], bool]], ...] = (
    # (logger, message start, which of its records) -- why each is benign here
    # At every in-place weight reload on CPU: layers whose tensors are not checkpoint weights (the
    # rotary cache; the LM head tied to the embedding) have nothing to load and keep their tensors.
    ("vllm.model_executor.model_loader.reload.layerwise", "%s: Failed to load weights", _layer_without_weights),
    # A converted model folder is float32; the engine runs in the run's dtype (model.dtype).
    ("vllm.model_executor.models.utils", "Attempted to load weight %s with dtype %s", _narrowed_to_run_dtype),
    # sleuth turns chunked prefill off on CPU on purpose (DEVELOPERS.md, "vLLM on CPU").
    ("vllm.engine.arg_utils", "This model does not officially support disabling chunked prefill", _always),
    # Each request carries its own seed; the process's global seed is sleuth's to set.
    ("vllm.engine.arg_utils", "The global random seed is set to", _always),
    ("vllm.v1.worker.cpu_worker", "CPU backend doesn't allow to use", _always),
    ("vllm.v1.engine.input_processor", "Passing raw prompts to InputProcessor is deprecated", _always),
    ("vllm.triton_utils.importing", "Triton is installed, but doesn't include CPU backend", _always),
    # vLLM 0.32 on CPU at every engine start: sleuth runs it eager on purpose (no torch.compile, no
    # CUDA graphs; without Triton the V1 model runner), which these restate.
    ("vllm.config.vllm", "Enforce eager set", _always),
    ("vllm.config.vllm", "Inductor compilation was disabled by user settings", _always),
    ("vllm.config.vllm", "Model Runner V2 requires Triton", _always),
    ("vllm.platforms.cpu", "Triton is not installed", _always),
    # Said for every model; only Gated DeltaNet layers keep an SSM state, float32 is the one it supports.
    ("vllm.platforms.cpu", "Reset SSM cache type to float32", _always),
    # tcmalloc / libiomp: `sleuth train` preloads mimalloc instead (system/allocator.py), and the
    # engine's speed is measured as it runs (docs/benchmarks.md, eval_cost and rollout).
    ("vllm.v1.worker.cpu_worker", "%s is not found in LD_PRELOAD", _always),
    # vLLM's CPU worker writes VLLM_DIST_IDENT into os.environ, and the next engine started in
    # that process, or in a process it starts, finds a VLLM_ variable missing from vLLM's own list.
    ("vllm.platforms.interface", "Unknown vLLM environment variable detected", _own_dist_ident),
    # bitsandbytes falls back to its own CPU kernel when the optional `kernels` package is absent.
    ("bitsandbytes.backends.cpu.ops", "Failed to load CPU gemm_4bit_forward", _always),
)


class _DropBenign(logging.Filter):
    def __init__(self, prefix: str, benign: Callable[[Args], bool]) -> None:
        super().__init__()
        self.prefix, self.benign = prefix, benign

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(self.prefix):
            return True
        args = record.args if isinstance(record.args, tuple) else ()
        return not self.benign(args)


def verbose_requested() -> bool:
    return os.environ.get(ENV, "").strip().lower() == "debug"


def configure_logging(verbose: bool | None = None) -> bool:
    """Quiet the libraries unless `verbose` (None: SLEUTH_LOG decides); returns whether verbose.
    Sets SLEUTH_LOG for the processes this one starts (Ray workers, verifier workers), and vLLM's
    own level through its environment variable, so call it before vLLM is imported."""
    verbose = verbose_requested() if verbose is None else verbose
    os.environ[ENV] = "debug" if verbose else "quiet"
    if verbose:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "DEBUG")
        return True
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # c10's start-up notes (NUMA binding)
    for name, prefix, benign in BENIGN:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropBenign) and f.prefix == prefix for f in logger.filters):
            logger.addFilter(_DropBenign(prefix, benign))
    # vLLM's triton shim touches a deprecated torch alias at import
    warnings.filterwarnings("ignore", message=r".*torch\.distributed\.reduce_op.* is deprecated", category=FutureWarning)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # "Loading weights" bars: sleuth prints its own progress
    except ImportError:
        pass
    return False
