"""`sleuth report RUN_DIR [--out DIR] [--eval SUMMARY.json|DIR ...]`: plots and report.html."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "report",
        help="plots and a self-contained report.html for a run and/or `sleuth eval` summaries",
        description="Plot a run's metrics (reward, validation accuracy with a power-law fit, completion "
        "length, entropy/KL, clip fractions, time per stage) and write one self-contained report.html "
        "with the config and sample completions. With --eval, also plot accuracy against ln(cost per "
        "problem) for several models and their frontier.",
    )
    p.add_argument("run_dir", nargs="?", metavar="RUN_DIR", help="a sleuth run directory")
    p.add_argument("--out", metavar="DIR", help="output folder (default RUN_DIR/report, or ./report)")
    p.add_argument("--eval", dest="eval_paths", nargs="+", default=[], metavar="PATH",
                   help="`sleuth eval` summary JSON files, or folders searched for them")
    p.add_argument("--max-samples", type=int, default=40, metavar="N",
                   help="sample completions shown in the page (default 40)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from sleuth.errors import UserError
    from sleuth.eval.report import write_report

    if args.max_samples < 0:
        raise UserError(f"--max-samples must be >= 0, got {args.max_samples}")
    page = write_report(args.run_dir, args.out, args.eval_paths, args.max_samples)
    print(page)
    return 0
