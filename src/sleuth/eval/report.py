"""`sleuth report`: plots and one self-contained report.html for a run and/or `sleuth eval` outputs.

    write_report(run_dir, out_dir)                       # curves, config, sample completions
    write_report(None, out_dir, eval_paths=[a, b])       # accuracy against ln(cost), a point per model

Inputs of a run directory: metrics.jsonl (one object per iteration, as sleuth.loop.train logs it; every
key but "iteration" is optional, so partial runs still plot; runs written before the metric
namespaces are read through sleuth.run.metrics.upgrade_row), config.yaml, samples.jsonl. Output: one PNG per plot and report.html with the same
images embedded as base64, so the file alone is readable offline.

Corrupt input: a metrics or samples line that is not JSON is skipped with a warning only when it
is the file's last line and lacks its newline (a write cut off by a killed run); any other bad
line is a DataError naming the file and line, since it means the file was damaged or is not ours.
A line nested too deeply for Python's JSON reader (RecursionError) is skipped with a warning, and
such an eval summary is skipped in a folder or a DataError when named.
"""

from __future__ import annotations

import base64
import html
import json
import os
import sys
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from sleuth.errors import DataError, UserError
from sleuth.eval.plots import Plot, plot_eval_frontier, run_plots, series, val_series
from sleuth.run.metrics import upgrade_row

MAX_TEXT_CHARS = 4000


@dataclass
class RunData:
    run_dir: Path
    metrics: list[dict[str, Any]]
    config_text: str | None
    samples: list[dict[str, Any]]
    warnings: list[str] = field(default_factory=list)




# ------------------------------------------------------------------ reading


def read_jsonl(path: Path, warnings: list[str]) -> list[dict[str, Any]]:
    """Objects of a JSONL file; see the module docstring for how bad lines are treated."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"cannot read {path}: {e}") from None
    lines = text.split("\n")
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except RecursionError:  # valid JSON perhaps, but nested past what Python reads: not sleuth's
            warnings.append(f"{path.name} line {number}: skipped a line nested too deeply to read")
            continue
        except json.JSONDecodeError:
            if number == len(lines):  # the last piece after the final newline: an interrupted write
                warnings.append(f"{path.name} line {number}: skipped a partial last line (interrupted write)")
                continue
            raise DataError(f"{path} line {number} is not valid JSON") from None
        if not isinstance(row, dict) or not isinstance(row.get("iteration"), int):
            raise DataError(f"{path} line {number} is not an object with an integer \"iteration\"")
        rows.append(row)
    return rows


def load_run(run_dir: str | Path) -> RunData:
    run = Path(run_dir)
    if not run.is_dir():
        raise UserError(f"run directory {run} does not exist")
    metrics_path = run / "metrics.jsonl"
    if not metrics_path.is_file():
        raise DataError(f"{run} has no metrics.jsonl (is it a sleuth run directory?)")
    warnings: list[str] = []
    metrics = [upgrade_row(row) for row in read_jsonl(metrics_path, warnings)]
    samples = read_jsonl(run / "samples.jsonl", warnings) if (run / "samples.jsonl").is_file() else []
    config_path = run / "config.yaml"
    config_text = config_path.read_text(encoding="utf-8", errors="replace") if config_path.is_file() else None
    return RunData(run, metrics, config_text, samples, warnings)


def _first(summary: dict[str, Any], *keys: str) -> Any:
    return next((summary[k] for k in keys if summary.get(k) is not None), None)


def _eval_entry(data: Any, path: Path) -> dict[str, Any] | None:
    """A normalized eval summary, or None when the JSON is not one."""
    if not isinstance(data, dict):
        return None
    k = data.get("k")
    accuracy = _first(data, "avg@k", f"avg@{k}", "avg", "accuracy")
    if not isinstance(accuracy, int | float) or isinstance(accuracy, bool):
        return None
    model = str(data.get("model") or path.parent.name)
    return {
        "model": Path(model).name or model,  # a run directory's name, not its whole path
        "task": str(data.get("task") or ""),
        "k": k,
        "accuracy": float(accuracy),
        "se": _first(data, "avg_se"),
        "pass": _first(data, "pass@k", f"pass@{k}", "pass_k"),
        "maj": _first(data, "maj@k", f"maj@{k}", "maj"),
        # All k samples' prompt and completion tokens: what the cost is computed from.
        "tokens": _first(data, "tokens_per_problem", "mean_completion_tokens"),
        "cost": _first(data, "cost_per_problem"),
    }


def load_eval_summaries(paths: Sequence[str | Path]) -> list[dict[str, Any]]:
    """Eval summaries from files, or from every *.json under a folder that looks like one."""
    entries = []
    for p in map(Path, paths):
        if p.is_dir():
            for f in sorted(p.rglob("*.json")):
                try:
                    entry = _eval_entry(json.loads(f.read_text(encoding="utf-8")), f)
                except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError):
                    entry = None  # other JSON files may share the folder
                if entry is not None:
                    entries.append(entry)
        elif p.is_file():
            try:
                data = json.loads(p.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
                raise DataError(f"eval summary {p} is not readable JSON: {e}") from None
            except RecursionError:
                raise DataError(f"eval summary {p} is nested too deeply to read") from None
            entry = _eval_entry(data, p)
            if entry is None:
                raise DataError(f"eval summary {p} has no numeric \"avg@k\" (is it a `sleuth eval` summary?)")
            entries.append(entry)
        else:
            raise UserError(f"eval summary path {p} does not exist")
    if paths and not entries:
        raise DataError(f"no `sleuth eval` summaries found in {', '.join(map(str, paths))}")
    return entries




# ------------------------------------------------------------------ html


def select_samples(samples: Sequence[dict[str, Any]], max_samples: int) -> list[dict[str, Any]]:
    """At most max_samples: the first logged iteration's samples (where the run started), then the
    latest iterations' until the budget is spent, so the page shows change without holding 10,000
    texts. Within an iteration, each problem's best comes right before its worst."""
    by_iter: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for s in samples:
        by_iter[s["iteration"]].append(s)
    iterations = sorted(by_iter)
    picked: dict[int, list[dict[str, Any]]] = {}
    budget = max_samples
    for it in iterations[:1] + iterations[:0:-1]:
        if budget <= 0:
            break
        rows = sorted(by_iter[it], key=lambda s: (str(s.get("problem_id", "")), s.get("kind") != "best",
                                                  -_num(s.get("reward"))))
        picked[it] = rows[:budget]
        budget -= len(picked[it])
    return [s for it in sorted(picked) for s in picked[it]]


def _num(v: Any) -> float:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else 0.0


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)


def _img(plot: Plot) -> str:
    data = base64.b64encode(plot.png).decode("ascii")
    note = f"<p class=note>{html.escape(plot.note)}</p>" if plot.note else ""
    return (f'<figure id="plot-{plot.name}"><img alt="{html.escape(plot.title)}" '
            f'src="data:image/png;base64,{data}">{note}</figure>')


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(c))}</td>" for c in r) + "</tr>" for r in rows)
    thead = f"<thead><tr>{head}</tr></thead>" if any(headers) else ""
    return f"<table>{thead}<tbody>{body}</tbody></table>"


CSS = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
h1{font-size:1.6em}h2{border-bottom:1px solid #ccc;padding-bottom:.2em;margin-top:2em}
figure{display:inline-block;margin:.5em}img{max-width:100%;border:1px solid #eee}
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ddd;padding:.25em .6em;text-align:left}
pre{background:#f6f6f6;padding:.6em;overflow-x:auto;white-space:pre-wrap;word-break:break-word}
.sample{border:1px solid #ddd;margin:.6em 0;padding:.4em .8em}.best{border-left:4px solid #2a2}
.worst{border-left:4px solid #c33}.note,.warn{color:#a60}"""


def render_html(title: str, run: RunData | None, plots: Sequence[Plot], fit: tuple[float, float] | None,
                evals: Sequence[dict[str, Any]], max_samples: int) -> str:
    parts = [f"<!DOCTYPE html><html lang=en><head><meta charset=utf-8><title>{html.escape(title)}</title>"
             f"<style>{CSS}</style></head><body><h1>{html.escape(title)}</h1>"]
    if run is not None:
        rows = run.metrics
        vx, vy, vkey = val_series(rows)
        summary: list[tuple[str, Any]] = [("run directory", str(run.run_dir)),
                                          ("iterations logged", len({r["iteration"] for r in rows}))]
        if rows:
            summary.append(("last iteration", rows[-1]["iteration"]))
        _, ty = series(rows, "rollout/reward_mean")
        if len(ty):
            summary.append(("last training reward", float(ty[-1])))
        if len(vy):
            best = int(np.argmax(vy))
            summary += [(f"best {vkey}", f"{vy[best]:.4g} at iteration {int(vx[best])}"),
                        (f"last {vkey}", float(vy[-1]))]
        if fit is not None:
            summary.append(("power-law fit of validation accuracy", f"{fit[0]:.4g} · iteration^{fit[1]:.4f}"))
        parts.append("<h2>Summary</h2>" + _table(["", ""], summary))
        for w in run.warnings:
            parts.append(f"<p class=warn>warning: {html.escape(w)}</p>")
    parts.append("<h2>Plots</h2>")
    parts.append("".join(_img(p) for p in plots) if plots else "<p>No metrics to plot yet.</p>")
    if evals:
        parts.append("<h2>Evaluations</h2>" + _table(
            ["model", "task", "k", "avg@k", "± se", "pass@k", "maj@k", "tokens/problem", "cost/problem"],
            [[e["model"], e["task"], e["k"], e["accuracy"], e["se"], e["pass"], e["maj"], e["tokens"], e["cost"]]
             for e in evals]))
    if run is not None:
        parts.append("<h2>Config</h2>")
        parts.append(f"<pre id=config>{html.escape(run.config_text)}</pre>" if run.config_text is not None
                     else "<p>(no config.yaml in the run directory)</p>")
        shown = select_samples(run.samples, max_samples)
        parts.append(f"<h2>Sample completions</h2><p>{len(shown)} of {len(run.samples)} logged samples: "
                     "the first logged iteration and the latest ones.</p>")
        for s in shown:
            kind = str(s.get("kind", ""))
            text = str(s.get("text", ""))
            if len(text) > MAX_TEXT_CHARS:
                text = text[:MAX_TEXT_CHARS] + f"\n… ({len(text) - MAX_TEXT_CHARS} more characters)"
            head = (f"iteration {s['iteration']} · {kind} · problem {s.get('problem_id', '?')} · "
                    f"reward {_fmt(s.get('reward'))}")
            parts.append(f'<div class="sample {html.escape(kind, quote=True)}"><b>{html.escape(head)}</b>'
                         f"<pre>{html.escape(text)}</pre></div>")
    parts.append("</body></html>")
    return "\n".join(parts)


def write_report(run_dir: str | Path | None, out_dir: str | Path | None = None,
                 eval_paths: Sequence[str | Path] = (), max_samples: int = 40) -> Path:
    """Write the PNGs and report.html into out_dir (default RUN_DIR/report); returns report.html."""
    if run_dir is None and not eval_paths:
        raise UserError("sleuth report needs a RUN_DIR or --eval summaries")
    run = load_run(run_dir) if run_dir is not None else None
    evals = load_eval_summaries(eval_paths)
    for w in run.warnings if run else []:
        print(f"sleuth report: warning: {w}", file=sys.stderr)
    plots, fit = run_plots(run.metrics) if run else ([], None)
    frontier, why = plot_eval_frontier(evals)
    if frontier is not None:
        plots.append(frontier)
    elif why:
        print(f"sleuth report: warning: no cost plot: {why}", file=sys.stderr)
    out = Path(out_dir) if out_dir is not None else (run.run_dir / "report" if run else Path("report"))
    try:
        out.mkdir(parents=True, exist_ok=True)
        for p in plots:
            (out / f"{p.name}.png").write_bytes(p.png)
        title = f"sleuth report: {run.run_dir.name}" if run else "sleuth report: evaluations"
        page = out / "report.html"
        tmp = page.with_suffix(".html.tmp")
        tmp.write_text(render_html(title, run, plots, fit, evals, max_samples), encoding="utf-8")
        os.replace(tmp, page)
    except OSError as e:
        raise UserError(f"cannot write the report to {out}: {e.strerror or e}") from None
    return page
