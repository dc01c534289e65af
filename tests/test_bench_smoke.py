"""Every bench/ script's `--smoke` run: the tiny model, seconds, the same code path as the full run.

Each script runs in its own process, as a user runs it, and must exit 0 and end with its one
`name=value` line holding exactly the headline names listed here: a metric key renamed in the
library, a function moved or a headline renamed breaks this test instead of a figure weeks later.
A new script in bench/ must be listed (helpers start with `_`). The figures themselves mean nothing
at these sizes and are not checked, only that each is a number. No script is skipped:
bench/gpu_generate.py and bench/gpu_train_step.py take their CPU path when CUDA is absent (static
decode steps instead of CUDA graphs, sleuth_packed attention instead of flex_attention), and
bench/rollout.py and bench/sync.py use vLLM where it is installed.

The selected scripts start together on first use, as many at a time as the machine has cores (at
most 4), each with one thread, and each test waits for its own: the file takes about half the time
of running them one after another on 2 cores.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"

HEADLINES: dict[str, set[str]] = {
    "async.py": {f"{mode}_{k}" for mode in ("sync", "one_step", "streaming") for k in ("s_per_group", "trainer_idle")}
                | {"one_step_speedup", "streaming_speedup"},
    "agent.py": {"tree_step_speedup", "tree_token_ratio", "overhead_median_ms", "overhead_p99_ms",
                 "gateway_share_median_ms", "episodes_per_s", "calls_per_s", "direct_s", "gateway_s"},
    "agent_packing.py": {"tree_step_speedup", "tree_token_ratio"},
    "block_mask.py": {f"{s}_{k}" for s in ("clue", "aime") for k in ("ref_ms", "layout_ms", "speedup")},
    "constant_answers.py": {"first_heldout", "first_many", "chance_many"},
    "eval_cost.py": {"prefill_tok_s", "prefill_of_bound", "decode_tok_s", "decode_of_bound", "eval200_s"},
    "fsdp_step.py": {"fsdp2_step_ratio"},
    "gpu_generate.py": {"tps_0_2B_64_dynamic", "tps_0_2B_64_static", "tps_0_6B_8_static", "step_ms_8",
                        "tps_0_6B_64_static", "step_ms_64", "tps_0_6B_256_static", "step_ms_256", "bound_ms_0_6B",
                        "gen_speedup"},
    "gpu_train_step.py": {f"{shape}{mode}_{k}" for shape in ("clue", "aime") for mode in ("", "_lora_base", "_full")
                          for k in ("speedup", "mfu", "selfcheck_mean")} | {"tflops_bf16"},
    "grade.py": {"grade_100kb_ms", "grade_100kb_full_scan_ms", "grade_100kb_adversarial_worst_ms",
                 "score_process_us", "score_inline_us"},
    "lora_layers.py": {"speedup"},
    "memory.py": {"peak_rss_gb", "iteration_s", "total_s"},
    "puzzles.py": {"d1_median_s", "d3_median_s", "d6_median_s", "d6_mean_s", "d6_p95_s", "d6_max_s",
                   "d6_cpu_median_s", "d6_cpu_mean_s", "d6_cpu_max_s"},
    "quantization.py": {"smollm2_none_vs_bf16", "smollm2_int8_vs_bf16", "smollm2_nf4_vs_bf16"},
    "report.py": {"report_s"},
    "reproducible_math.py": {"step_slowdown"},
    "rollout.py": {"vllm_tok_s", "hf_tok_s", "naive_tok_s", "hf_vs_naive", "vllm_logprob_mad", "hf_logprob_mad"},
    "scale.py": {"sync_gb_s", "lora_sync_ms", "broadcast_gb_s", "broadcast_lora_ms", "ray_overhead"},
    "sync.py": {"full_s", "adapter_s", "full_mb", "adapter_mb", "same_tokens", "rollout_full_s", "rollout_adapter_s"},
    "train_step.py": {"clue_speedup", "aime_speedup", "clue_full_speedup", "aime_full_speedup", "mfu",
                      "peak_rss_gb"},
    "vs_trl.py": {"trl_s_per_iter", "sleuth_s_per_iter", "speedup"},
}
"""Script -> the names on its last line in a smoke run."""

NAN_ALLOWED: dict[str, set[str]] = {
    "rollout.py": {"vllm_tok_s", "vllm_logprob_mad"},  # where vLLM is not installed
}
"""Script -> headline names that may be nan in a smoke run."""

SLOWEST_FIRST = ["scale.py", "sync.py", "fsdp_step.py", "reproducible_math.py", "rollout.py", "vs_trl.py",
                 "memory.py"]
SCRIPTS = SLOWEST_FIRST + sorted(set(HEADLINES) - set(SLOWEST_FIRST))
"""The order the runs start and the tests wait in (each test waits about as long as its own run):
the slowest first, so the short runs fill the gaps at the end."""


def run_smoke(script: str, tmp: Path) -> subprocess.CompletedProcess:
    # One thread per process: on a small shared machine idle OpenMP threads spinning for work that
    # never comes cost more CPU than the tiny model's whole smoke run.
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    return subprocess.run([sys.executable, str(BENCH / script), "--smoke"], capture_output=True, text=True,
                          timeout=900, cwd=tmp, env=env)


@pytest.fixture(scope="module")
def smoke_runs(request: pytest.FixtureRequest,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Future]]:
    """script -> its running (or finished) smoke run, for the scripts this session selected."""
    selected = {item.callspec.params["script"] for item in request.session.items
                if item.module is request.module and hasattr(item, "callspec")}
    with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
        runs = {s: pool.submit(run_smoke, s, tmp_path_factory.mktemp(s.removesuffix(".py")))
                for s in SCRIPTS if s in selected}
        yield runs
        for future in runs.values():
            future.cancel()


def last_line_values(stdout: str) -> dict[str, str]:
    lines = stdout.strip().splitlines()
    assert lines, "nothing on stdout"
    pairs = [item.partition("=") for item in lines[-1].split()]
    assert pairs and all(sep == "=" and k and v for k, sep, v in pairs), f"not a name=value line: {lines[-1]!r}"
    return {k: v for k, _, v in pairs}


OWN_SMOKE_TESTS = {"ladder.py": "test_bench_ladder.py", "sandbox.py": "test_bench_sandbox.py",
                   "gateway_hostile.py": "test_bench_gateway_hostile.py", "environments.py": "test_environments.py",
                   "learning.py": "test_bench_learning.py"}
"""Scripts whose --smoke run a test file of their own checks (with what their headline needs: root
namespaces, the environment libraries), so it is not run twice."""


def test_every_script_is_listed():
    scripts = {p.name for p in BENCH.glob("*.py") if not p.name.startswith("_")}
    assert scripts == set(HEADLINES) | set(OWN_SMOKE_TESTS), "bench/ scripts and HEADLINES differ"
    tests = Path(__file__).parent
    for script, test in OWN_SMOKE_TESTS.items():
        text = (tests / test).read_text()
        assert script in text and "--smoke" in text, f"{test} runs no --smoke of bench/{script}"


@pytest.mark.parametrize("script", SCRIPTS)
def test_smoke_run_ends_with_its_headline(script: str, smoke_runs: dict[str, Future]) -> None:
    proc = smoke_runs[script].result()
    assert proc.returncode == 0, proc.stderr[-3000:]
    values = last_line_values(proc.stdout)
    assert set(values) == HEADLINES[script]
    for name, value in values.items():
        number = float(value)  # every headline is a number
        assert not math.isnan(number) or name in NAN_ALLOWED.get(script, set()), f"{name}={value}"


def test_a_smoke_run_that_fails_fails_the_test(tmp_path: Path) -> None:
    """The check itself: a script whose last line is not name=value pairs is caught."""
    with pytest.raises(AssertionError, match="not a name=value line"):
        last_line_values("table\nspeedup=1.2 done\n")
    assert last_line_values("| a |\nx=1 y=nan\n") == {"x": "1", "y": "nan"}


@pytest.mark.parametrize(("script", "args"), [
    ("eval_cost.py", ["--problems", "0"]), ("eval_cost.py", ["--kv-cache-gb", "-1"]), ("eval_cost.py", ["--kv-cache-gb", "nan"]),
    ("async.py", ["--rollout-workers", "0"]), ("async.py", ["--cpus-per-worker", "0"]),
])
def test_bad_flags_exit_2_with_one_line(script: str, args: list[str], tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(f"{script}: error: ")
