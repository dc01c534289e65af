"""What this CPU can do fast: bf16 matmul acceleration, and a one-line description for benchmarks.

    if not cpu_bf16_fast():
        dtype = torch.float32        # bf16 on an AVX2-only CPU is ~50x slower than float32
    print(f"# cpu: {cpu_description()}")

On x86 a bf16 matmul is fast only with native bf16 instructions (AVX512_BF16, or AMX tiles);
without them (e.g. an AMD EPYC with AVX2 only) PyTorch emulates bf16 and a 1024^3 matmul takes
seconds. The flags come from /proc/cpuinfo (Linux), else from PyTorch's own dispatch level.
"""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path

BF16_FLAGS = ("avx512_bf16", "amx_bf16")
"""x86 CPU flags (as /proc/cpuinfo spells them) that make bf16 matmuls fast."""

SHOWN_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")
"""Flags printed by cpu_description: the ones that decide matmul speed."""


def parse_cpuinfo(text: str) -> tuple[str, frozenset[str]]:
    """(model name, flags) of the first CPU described in /proc/cpuinfo text."""
    model, flags = "", frozenset[str]()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key in ("flags", "Features") and not flags:  # x86 / arm
            flags = frozenset(value.split())
    return model, flags


@functools.cache
def _cpuinfo() -> tuple[str, frozenset[str]]:
    """parse_cpuinfo of this machine; ("", {}) where there is no /proc/cpuinfo."""
    try:
        return parse_cpuinfo(Path("/proc/cpuinfo").read_text())
    except OSError:
        return "", frozenset()


def _torch_capability() -> str:
    """PyTorch's CPU dispatch level (e.g. "AVX2", "AVX512"); "" when torch cannot tell."""
    try:
        import torch

        return str(torch.backends.cpu.get_cpu_capability())
    except Exception:  # an old torch without the call: rely on /proc/cpuinfo
        return ""


def cpu_bf16_fast() -> bool:
    """True when this CPU runs bf16 matmuls natively (AVX512_BF16 or AMX on x86; bf16 on Apple/arm).

    An AVX2-only x86 CPU -> False: choose float32 for CPU work there. So does an x86 CPU with the
    flags whose oneDNN is capped below them (ONEDNN_MAX_CPU_ISA, read at each call).
    """
    onednn_cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "")
    _, flags = _cpuinfo()
    if flags:
        return bf16_fast_with(flags, platform.machine(), onednn_cap)
    # No /proc/cpuinfo (macOS, Windows): Apple silicon has bf16; torch's AMX level implies AMX-BF16.
    if platform.system() == "Darwin" and platform.machine() == "arm64":
        return True
    return "AMX" in _torch_capability().upper() and onednn_allows_bf16(onednn_cap)


def bf16_fast_with(flags: frozenset[str] | set[str], machine: str, onednn_cap: str = "") -> bool:
    """The verdict from a CPU's flags: AVX512_BF16/AMX-BF16 on x86 (unless oneDNN is capped below
    them, `onednn_cap` as ONEDNN_MAX_CPU_ISA spells it), the bf16 extension on arm."""
    if any(f in flags for f in BF16_FLAGS):
        return onednn_allows_bf16(onednn_cap)
    return "bf16" in flags and machine.lower() in ("aarch64", "arm64")


def onednn_allows_bf16(max_isa: str) -> bool:
    """Whether oneDNN, capped at `max_isa` (ONEDNN_MAX_CPU_ISA), may use native bf16 instructions.

    PyTorch's CPU bf16 matmuls run in oneDNN: capped below AVX512_CORE_BF16 (e.g. `AVX2`, to mimic
    an older CPU) they fall back to emulation, measured 0.9 GFLOP/s against 638 uncapped on an
    AVX-512 + AMX Xeon, even though /proc/cpuinfo still lists the bf16 flags.
    """
    isa = max_isa.strip().upper()
    return not isa or isa in ("ALL", "DEFAULT") or any(k in isa for k in ("BF16", "AMX", "FP16", "AVX10"))


def cpu_dtype(preferred: str = "bfloat16") -> str:
    """The dtype name to use for CPU compute: `preferred` unless it is bf16 and bf16 is slow here."""
    return preferred if preferred != "bfloat16" or cpu_bf16_fast() else "float32"


def cpu_description() -> str:
    """One line: CPU model, cores, the matmul-relevant flags, torch's dispatch level, bf16 verdict."""
    model, flags = _cpuinfo()
    model = model or platform.processor() or platform.machine() or "unknown CPU"
    shown = [f for f in SHOWN_FLAGS if f in flags]
    no_avx512 = "" if any(f.startswith("avx512") for f in flags) else ", no AVX-512"
    no_amx = "" if any(f.startswith("amx") for f in flags) else ", no AMX"
    capability = _torch_capability()
    torch_text = f"; torch dispatch {capability}" if capability else ""
    verdict = "fast" if cpu_bf16_fast() else "slow (emulated)"
    return (f"{model}, {os.cpu_count()} cores; flags: {' '.join(shown) or 'none found'}{no_avx512}{no_amx}"
            f"{torch_text}; bf16 matmul {verdict}")


def resolve_dtype(name: str) -> str:
    """model.dtype with "auto" resolved for this machine: bfloat16 on a GPU that supports it and on
    a CPU with native bf16 matmuls, float32 elsewhere. Other names are returned as they are."""
    if name != "auto":
        return name
    import torch

    if torch.cuda.is_available():
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float32"
    return cpu_dtype("bfloat16")


def reproducible_cpu_math() -> None:
    """loop.deterministic: ask Intel MKL (PyTorch's CPU BLAS and vector math) for reproducible
    results (its "conditional numerical reproducibility", MKL_CBWR=COMPATIBLE).

    Without it, MKL under two threads gave results differing in the last bits from one process to
    the next for the same inputs: the in-process transformers engine's logprobs took one of three
    values over ten identical runs (the prefill's rotary cos already differed), and a run killed
    while saving and resumed with Ray rollout workers left the uninterrupted run's samples in 1-5 of
    10 tries. With it: 8 of 8 and 10 of 10 identical. The price is MKL's portable code path: on a
    2-core AVX-512 + AMX CPU the default's training step takes 3.2x as long in float32 and 1.5x in
    bf16 (bench/reproducible_math.py; docs/benchmarks.md "reproducible_math").

    MKL reads the setting at its first call, so it is set before the run's first matmul; processes
    started later (Ray workers, FSDP2 ranks) inherit it. A value already in the environment wins.
    A Python caller that has already run torch matmuls must export it before starting Python."""
    os.environ.setdefault("MKL_CBWR", "COMPATIBLE")
