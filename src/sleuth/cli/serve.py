"""`sleuth serve --model PATH_OR_RUN_DIR [--port 8000] [--engine hf|vllm]`: the gateway standalone.

The same OpenAI-compatible API the training loop gives episode tasks (`/v1/chat/completions`,
`/v1/models`, see sleuth.gateway), on 127.0.0.1, for evaluating a trained model with any agent
code or client:

    sleuth serve --model runs/my-run --port 8000
    openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none")
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from sleuth.errors import UserError


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve", help="serve a model or a run's trained model over an OpenAI-compatible API on 127.0.0.1",
        description="Serve /v1/chat/completions and /v1/models from the rollout engine on 127.0.0.1 "
                    "until interrupted (the gateway episode tasks train through).",
    )
    p.add_argument("--model", required=True, metavar="PATH_OR_RUN_DIR",
                   help="an HF model folder, a sleuth run directory, or the alias smollm2-135m-instruct")
    p.add_argument("--port", type=int, default=8000, help="TCP port on 127.0.0.1 (default 8000)")
    p.add_argument("--engine", choices=["auto", "hf", "vllm"], default="auto",
                   help="rollout engine (default auto: vLLM when installed)")
    p.add_argument("--max-tokens", type=int, default=512, metavar="N",
                   help="max new tokens when a request gives none (default 512)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="dotted config overrides for the engine, e.g. rollout.max_model_len=4096")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from sleuth.cli.eval import _base_config, model_folder
    from sleuth.gateway.app import Gateway, run_forever
    from sleuth.models import load_tokenizer
    from sleuth.records import SamplingParams
    from sleuth.rollout.factory import make_engine

    if not 0 < args.port < 65536:
        raise UserError(f"--port must be in 1..65535, got {args.port}")
    if args.max_tokens < 1:
        raise UserError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    cfg = _base_config(args.model, list(args.overrides))
    cfg.rollout.engine = args.engine
    scratch = Path(tempfile.mkdtemp(prefix="sleuth-serve-"))
    try:
        folder = model_folder(args.model, cfg, scratch)
        engine = make_engine(cfg.rollout, str(folder), cfg.model.dtype, cfg.loop.seed)
        try:
            gateway = Gateway(engine, load_tokenizer(str(folder)), SamplingParams(max_tokens=args.max_tokens))
            print(f"serving {args.model} at http://127.0.0.1:{args.port}/v1 (Ctrl-C stops)", file=sys.stderr,
                  flush=True)
            run_forever(gateway, "127.0.0.1", args.port)
        finally:
            engine.close()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0
