"""`sleuth serve --model PATH_OR_RUN_DIR [--port 8000] [--engine hf|vllm]`: the gateway standalone.

The same OpenAI-compatible API the training loop gives episode tasks (`/v1/chat/completions`,
`/v1/models`, see sleuth.gateway), on 127.0.0.1, for evaluating a trained model with any agent
code or client:

    sleuth serve --model runs/my-run --port 8000
    openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none")

Serving runs no user code: of a run directory's config only the model, rollout and loop sections
are read (its task and algorithm sections, which may name modules, are never validated or
imported). The port is bound before the model loads: a port in use is one line and exit 2.
"""

from __future__ import annotations

import argparse
import errno
import shutil
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

from sleuth.errors import UserError


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve", help="serve a model or a run's trained model over an OpenAI-compatible API on 127.0.0.1",
        description="Serve /v1/chat/completions and /v1/models from the rollout engine on 127.0.0.1 "
                    "until interrupted (the gateway episode tasks train through).",
    )
    p.add_argument("--model", required=True, metavar="PATH_OR_RUN_DIR",
                   help="an HF model folder, a sleuth run directory, or an alias "
                        "(smollm2-135m-instruct, qwen2.5-coder-0.5b-instruct)")
    p.add_argument("--port", type=int, default=8000, help="TCP port on 127.0.0.1 (default 8000)")
    p.add_argument("--engine", choices=["auto", "hf", "vllm"], default="auto",
                   help="rollout engine (default auto: vLLM when installed)")
    p.add_argument("--max-tokens", type=int, default=512, metavar="N",
                   help="max new tokens when a request gives none (default 512)")
    p.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                   help="also answer requests whose Host header names NAME (default: loopback names only, "
                        "so web pages cannot reach the server through DNS rebinding; '*' allows any)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="dotted config overrides for the engine, e.g. rollout.max_model_len=4096")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from sleuth.cli.eval import model_folder
    from sleuth.gateway.app import Gateway, run_forever
    from sleuth.records import SamplingParams
    from sleuth.rollout.factory import make_engine
    from sleuth.system.models import load_tokenizer

    if not 0 < args.port < 65536:
        raise UserError(f"--port must be in 1..65535, got {args.port}")
    if args.max_tokens < 1:
        raise UserError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    cfg = serve_config(args.model, list(args.overrides))
    cfg.rollout.engine = args.engine
    sock = bind(HOST, args.port)  # before the model loads: a port in use costs nothing
    scratch = Path(tempfile.mkdtemp(prefix="sleuth-serve-"))
    try:
        folder = model_folder(args.model, cfg, scratch)
        engine = make_engine(cfg.rollout, str(folder), cfg.model.dtype, cfg.loop.seed)
        try:
            gateway = Gateway(engine, load_tokenizer(str(folder)), SamplingParams(max_tokens=args.max_tokens))
            print(f"serving {args.model} at http://127.0.0.1:{args.port}/v1 (Ctrl-C stops)", file=sys.stderr,
                  flush=True)
            run_forever(gateway, sock, tuple(args.allow_host))
        finally:
            engine.close()
    finally:
        sock.close()
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


HOST = "127.0.0.1"
SERVE_SECTIONS = ("model", "rollout", "loop")
"""The config sections serving reads; the others (task, algorithm) may name user code."""


def serve_config(model: str, overrides: list[str]) -> Any:  # -> Config
    """The engine's config: a run directory's model, rollout and loop sections (nothing that names
    code is read, so nothing is imported), else the embedded default's."""
    from sleuth.cli.eval import is_run_dir
    from sleuth.cli.train import default_config_path
    from sleuth.config import load_config

    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise UserError(f"override '{bad[0]}' is not of the form section.key=value")
    path = Path(model) / "config.yaml" if is_run_dir(Path(model)) else default_config_path()
    return load_config(path, overrides, sections=SERVE_SECTIONS)


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port, or UserError naming the port."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        why = "is in use (another server?)" if e.errno == errno.EADDRINUSE else f"cannot be bound: {e.strerror or e}"
        raise UserError(f"--port {port}: {host}:{port} {why}; choose another --port") from None
    return sock
