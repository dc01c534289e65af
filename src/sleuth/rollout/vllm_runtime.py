"""Process-wide bookkeeping around in-process vLLM engines (vllm_engine.py): how many are alive
(vLLM's parallel groups live in module globals), a stats logger that counts what sleuth reports
(preemptions, prefix-cache hits), and handing the CPU KV cache's pages back between rollouts."""

from __future__ import annotations

import threading
from typing import Any

_LIVE = [0]
_LIVE_LOCK = threading.Lock()


def count_live_engines(change: int) -> None:
    """Count the in-process vLLM engines; when the last one closes, drop vLLM's process-wide
    parallel groups. vLLM keeps them in module globals, and an engine started later in the same
    process would otherwise reuse the first engine's groups (a mixture-of-experts model after a
    dense one then finds no expert-parallel group and fails to load)."""
    with _LIVE_LOCK:
        _LIVE[0] += change
        if change < 0 and _LIVE[0] == 0:
            from vllm.distributed.parallel_state import (
                destroy_distributed_environment,
                destroy_model_parallel,
            )

            destroy_model_parallel()
            destroy_distributed_environment()


def stat_counter(counts: dict[str, int]) -> type:
    """A vLLM stat-logger class that adds each engine step's preemptions and prefix-cache queries
    and hits to `counts` (vLLM instantiates it itself: pass the class in `stat_loggers`)."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class _Counter(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                   engine_idx: int = 0) -> None:
            if iteration_stats is not None:
                counts["preemptions"] += iteration_stats.num_preempted_reqs
            if scheduler_stats is not None:
                counts["prefix_queries"] += scheduler_stats.prefix_cache_stats.queries
                counts["prefix_hits"] += scheduler_stats.prefix_cache_stats.hits

        def log_engine_initialized(self) -> None:
            pass

    return _Counter


def release_kv_cache(worker: Any) -> int:
    """Runs on vLLM's worker (in this process): its KV cache tensors' pages back to the system."""
    from sleuth.system.allocator import release_pages

    runner = getattr(worker, "worker", worker).model_runner
    return release_pages(runner.kv_caches)
