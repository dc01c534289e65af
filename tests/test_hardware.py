"""CPU bf16 detection and the benchmark CPU line."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest
import torch

from sleuth.system.hardware import (
    bf16_fast_with,
    cpu_bf16_fast,
    cpu_description,
    cpu_dtype,
    onednn_allows_bf16,
    parse_cpuinfo,
    resolve_dtype,
)
from sleuth.system.models import load_causal_lm

EPYC_AVX2 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13
flags\t\t: fpu vme sse sse2 avx avx2 fma bmi2
processor\t: 1
model name\t: AMD EPYC 7B13
flags\t\t: fpu vme sse sse2 avx avx2 fma bmi2
"""

SAPPHIRE_RAPIDS = """model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: avx2 avx512f avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8
"""


def test_parse_cpuinfo_reads_the_first_cpu() -> None:
    model, flags = parse_cpuinfo(EPYC_AVX2)
    assert model == "AMD EPYC 7B13"
    assert "avx2" in flags and "avx512f" not in flags


def test_bf16_verdict_from_flags() -> None:
    assert not bf16_fast_with(parse_cpuinfo(EPYC_AVX2)[1], "x86_64")
    assert bf16_fast_with(parse_cpuinfo(SAPPHIRE_RAPIDS)[1], "x86_64")
    assert bf16_fast_with({"avx512f", "avx512_bf16"}, "x86_64")
    assert bf16_fast_with({"fp", "asimd", "bf16"}, "aarch64")
    assert not bf16_fast_with({"avx2", "avx512f"}, "x86_64")  # AVX-512 without its bf16 extension


def test_onednn_cap_below_bf16_makes_bf16_slow(monkeypatch: pytest.MonkeyPatch) -> None:
    """ONEDNN_MAX_CPU_ISA=AVX2 makes oneDNN emulate bf16 matmuls whatever the CPU has, so auto
    must pick float32 under it; caps at or above the bf16 instructions leave the verdict alone."""
    assert onednn_allows_bf16("") and onednn_allows_bf16("ALL") and onednn_allows_bf16("default")
    assert onednn_allows_bf16("AVX512_CORE_BF16") and onednn_allows_bf16("avx512_core_amx")
    assert onednn_allows_bf16("AVX10_1_512_AMX_FP16")
    for cap in ("AVX2", "avx512_core", "AVX512_CORE_VNNI", "SSE41"):
        assert not onednn_allows_bf16(cap), cap
    amx = parse_cpuinfo(SAPPHIRE_RAPIDS)[1]
    assert not bf16_fast_with(amx, "x86_64", "AVX2") and bf16_fast_with(amx, "x86_64", "AVX512_CORE_AMX")
    assert bf16_fast_with({"fp", "asimd", "bf16"}, "aarch64", "AVX2")  # an x86 cap says nothing on arm
    verdict = cpu_bf16_fast()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    if Path("/proc/cpuinfo").exists():
        assert not cpu_bf16_fast()
        assert cpu_dtype("bfloat16") == "float32"
        if not torch.cuda.is_available():
            assert resolve_dtype("auto") == "float32"
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_AMX")
    assert cpu_bf16_fast() == verdict


def test_this_machine_agrees_with_its_cpuinfo() -> None:
    info = Path("/proc/cpuinfo")
    if info.exists():
        _, flags = parse_cpuinfo(info.read_text())
        assert cpu_bf16_fast() == bf16_fast_with(flags, platform.machine())
    assert cpu_dtype("float32") == "float32"
    assert cpu_dtype("bfloat16") == ("bfloat16" if cpu_bf16_fast() else "float32")


def test_description_is_one_line_with_the_verdict() -> None:
    text = cpu_description()
    assert "\n" not in text
    assert ("bf16 matmul fast" in text) == cpu_bf16_fast()
    if not cpu_bf16_fast():
        assert "slow (emulated)" in text


def test_resolve_dtype_auto_follows_the_machine(tiny_model_dir: Path) -> None:
    """Explicit names pass through; auto is bf16 only where it is fast (CUDA with bf16, or a CPU with
    native bf16), and every loader of model.dtype applies it."""
    assert resolve_dtype("float32") == "float32" and resolve_dtype("bfloat16") == "bfloat16"
    if torch.cuda.is_available():
        expected = "bfloat16" if torch.cuda.is_bf16_supported() else "float32"
    else:
        expected = "bfloat16" if cpu_bf16_fast() else "float32"
    assert resolve_dtype("auto") == expected
    model = load_causal_lm(str(tiny_model_dir), "auto")
    assert next(model.parameters()).dtype == getattr(torch, expected)
