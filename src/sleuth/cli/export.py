"""`sleuth export RUN_DIR --out DIR [--checkpoint latest|best|NAME] [--adapter-only]`: a merged HF model folder
(dequantized when the run trained on a quantized base), or the LoRA adapter alone."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from sleuth.errors import UserError
from sleuth.system import fsio


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "export",
        help="write a run's trained weights as a plain HF model folder (LoRA merged)",
        description="Load a checkpoint of RUN_DIR onto its base model and write the merged weights, "
        "config and tokenizer to DIR, a folder that transformers and vLLM load directly.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--out", required=True, metavar="DIR", help="output folder (must not exist or be empty)")
    p.add_argument("--checkpoint", default="latest", metavar="WHICH",
                   help="latest (default), best (by validation reward), or a checkpoint folder name")
    p.add_argument("--adapter-only", action="store_true",
                   help="write the LoRA adapter (PEFT folder) instead of merged weights")
    p.set_defaults(func=run)


def export_checkpoint(run_dir: Path, which: str, out: Path, cfg: Any = None, adapter_only: bool = False) -> Path:
    """Merge checkpoint `which` of run_dir into a new HF folder at `out` (written atomically), or
    with adapter_only write its LoRA adapter (adapter_config.json + adapter_model.safetensors)."""
    from sleuth.cli.train import run_config
    from sleuth.run.checkpoint import POLICY_DIR, CheckpointManager
    from sleuth.train.policy import Policy

    cfg = cfg if cfg is not None else run_config(run_dir)
    if adapter_only and not cfg.model.lora.enabled:
        raise UserError(f"--adapter-only: the run in {run_dir} trained full weights, not a LoRA adapter")
    checkpoint = CheckpointManager(run_dir / "checkpoints").find(which, only=POLICY_DIR)  # weights alone
    policy = Policy.from_config(cfg.model, need_reference=False, device="cpu")
    policy.load_weights(checkpoint.path / POLICY_DIR)
    with fsio.atomic_folder(out) as tmp:
        if adapter_only:
            policy.save(tmp)
        else:
            policy.export_merged(tmp)
    return out


def run(args: argparse.Namespace) -> int:
    run_dir, out = Path(args.run_dir), Path(args.out)
    if not (run_dir / "config.yaml").is_file():
        raise UserError(f"{run_dir} is not a sleuth run directory (no config.yaml)")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out {out} already exists and is not an empty folder")
    fsio.check_writable(out.parent if not out.exists() else out)  # before the model loads
    export_checkpoint(run_dir, args.checkpoint, out, adapter_only=args.adapter_only)
    print(out)
    return 0
