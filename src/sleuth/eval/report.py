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
import io
import json
import math
import os
import sys
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from sleuth.errors import DataError, UserError
from sleuth.run.metrics import upgrade_row

VAL_KEYS = ("val/reward", "val/accuracy")
TIME_PARTS = (("time/rollout_s", "generation"), ("time/score_s", "scoring"), ("time/train_s", "training"),
              ("time/sync_s", "weight sync"), ("time/eval_s", "evaluation"))
MAX_TEXT_CHARS = 4000


@dataclass
class RunData:
    run_dir: Path
    metrics: list[dict[str, Any]]
    config_text: str | None
    samples: list[dict[str, Any]]
    warnings: list[str] = field(default_factory=list)


@dataclass
class Plot:
    name: str
    title: str
    png: bytes
    note: str = ""


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


# ------------------------------------------------------------------ numbers


def series(rows: Sequence[dict[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(iterations, values) of the rows holding a finite number under key."""
    xs, ys = [], []
    for row in rows:
        v = row.get(key)
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
            xs.append(row["iteration"])
            ys.append(float(v))
    return np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)


def val_series(rows: Sequence[dict[str, Any]]) -> tuple[np.ndarray, np.ndarray, str]:
    for key in VAL_KEYS:
        x, y = series(rows, key)
        if len(x):
            return x, y, key
    return np.zeros(0), np.zeros(0), VAL_KEYS[0]


def fit_power_law(x: np.ndarray, y: np.ndarray) -> tuple[float, float] | None:
    """(c, b) of y = c * x**b by least squares on log y = log c + b log x, over x > 0 and y > 0.

    None when fewer than two distinct positive x remain.
    """
    keep = (x > 0) & (y > 0)
    lx, ly = np.log(x[keep]), np.log(y[keep])
    if len(np.unique(lx)) < 2:
        return None
    b, log_c = np.polyfit(lx, ly, 1)
    return float(math.exp(log_c)), float(b)


def pareto_frontier(costs: Sequence[float], accuracies: Sequence[float]) -> list[int]:
    """Indices of the models no other model beats on both cost (lower) and accuracy (higher),
    ordered by cost."""
    order = sorted(range(len(costs)), key=lambda i: (costs[i], -accuracies[i]))
    frontier, best = [], -math.inf
    for i in order:
        if accuracies[i] > best:
            frontier.append(i)
            best = accuracies[i]
    return frontier


# ------------------------------------------------------------------ plots


def _figure(title: str, xlabel: str = "iteration", ylabel: str = "") -> tuple[Any, Any]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    if ylabel:
        ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    return fig, ax


def _png(fig: Any) -> bytes:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def _lines_plot(rows: Sequence[dict[str, Any]], name: str, title: str, keys: Sequence[tuple[str, str]],
                ylabel: str = "") -> Plot | None:
    """One line per (key, label) present; None when none of the keys has data."""
    present = [(series(rows, k), label) for k, label in keys]
    present = [(xy, label) for xy, label in present if len(xy[0])]
    if not present:
        return None
    fig, ax = _figure(title, ylabel=ylabel)
    for (x, y), label in present:
        ax.plot(x, y, label=label, linewidth=1.2, marker="o" if len(x) <= 30 else None, markersize=3)
    ax.legend(loc="best")
    return Plot(name, title, _png(fig))


def plot_reward(rows: Sequence[dict[str, Any]]) -> Plot | None:
    tx, ty = series(rows, "rollout/reward_mean")
    vx, vy, vkey = val_series(rows)
    if not len(tx) and not len(vx):
        return None
    fig, ax = _figure("Training reward and validation accuracy", ylabel="reward")
    if len(tx):
        ax.plot(tx, ty, label="training reward (mean)", linewidth=1.0, alpha=0.8)
    if len(vx):
        se = dict(zip(*series(rows, f"{vkey}_se")))
        ax.errorbar(vx, vy, yerr=[se.get(x, 0.0) for x in vx] if se else None, label=f"validation ({vkey})",
                    marker="o", markersize=4, linewidth=1.5, capsize=2)
    ax.legend(loc="best")
    return Plot("reward", "Training reward and validation accuracy", _png(fig))


def reward_against_minutes(rows: Sequence[dict[str, Any]]) -> tuple[np.ndarray, np.ndarray, np.ndarray, str]:
    """(minutes, held-out reward, its se, key) of the rows that hold both time/elapsed_min and a
    validation reward: the curve of reward bought per minute of wall clock."""
    _, _, vkey = val_series(rows)
    points = [(r["time/elapsed_min"], r[vkey], r.get(f"{vkey}_se") or 0.0) for r in rows
              if isinstance(r.get("time/elapsed_min"), int | float) and isinstance(r.get(vkey), int | float)]
    m, v, se = (np.asarray(c, dtype=float) for c in zip(*points, strict=True)) if points else (np.zeros(0),) * 3
    return m, v, se, vkey


def plot_reward_time(rows: Sequence[dict[str, Any]]) -> Plot | None:
    m, v, se, vkey = reward_against_minutes(rows)
    if not len(m):
        return None
    title = "Held-out reward against wall-clock minutes"
    fig, ax = _figure(title, xlabel="minutes since the run started (setup and evaluations included)",
                      ylabel=vkey)
    ax.errorbar(m, v, yerr=se, marker="o", markersize=4, linewidth=1.5, capsize=2, label=vkey)
    for key, name, style in (("val/chance", "chance", "--"), ("val/constant", "best constant answer", ":")):
        level = [r[key] for r in rows if isinstance(r.get(key), int | float)]
        if level:
            ax.axhline(level[0], color="gray", linestyle=style, linewidth=1, label=f"{name} {level[0]:.3f}")
    ax.legend(loc="best")
    return Plot("reward_time", title, _png(fig))


def plot_power_law(rows: Sequence[dict[str, Any]]) -> tuple[Plot | None, tuple[float, float] | None]:
    """Validation accuracy on log-log axes with y = c * iteration**b fitted over the improving phase.

    Runs tend to improve along such a line, then plateau and decline; fitting through the decline
    would bend the exponent, so the fit stops at the best validation point (all points are drawn).
    """
    x, y, vkey = val_series(rows)
    keep = (x > 0) & (y > 0)
    if keep.sum() < 2:
        return None, None
    order = np.argsort(x[keep], kind="stable")
    px, py = x[keep][order], y[keep][order]
    peak = int(np.argmax(py))
    upto = peak + 1 if peak >= 1 else len(px)
    fit = fit_power_law(px[:upto], py[:upto])
    title = "Validation accuracy against iteration (log-log)"
    fig, ax = _figure(title, xlabel="iteration", ylabel=vkey)
    ax.loglog(px[:upto], py[:upto], "o", markersize=4, label=f"{vkey} (fitted)")
    notes = []
    if upto < len(px):
        ax.loglog(px[upto:], py[upto:], "x", markersize=5, color="gray", label=f"{vkey} after the best")
        notes.append(f"fitted up to the best validation point (iteration {int(px[peak])})")
    if (~keep).any():
        notes.append(f"{int((~keep).sum())} point(s) at iteration 0 or accuracy 0 left out (log axes)")
    if fit is not None:
        c, b = fit
        grid = np.geomspace(px[:upto].min(), px.max(), 50)
        ax.loglog(grid, c * grid**b, "-", label=f"fit: {c:.3g} · iteration^{b:.3f}")
        ax.set_title(f"{title}\nfitted exponent b = {b:.3f}")
    ax.legend(loc="best")
    return Plot("val_power_law", title, _png(fig), "; ".join(notes)), fit


def plot_time(rows: Sequence[dict[str, Any]]) -> Plot | None:
    parts = [(key, label, dict(zip(*series(rows, key)))) for key, label in TIME_PARTS]
    parts = [p for p in parts if p[2]]
    if not parts:
        return None
    iterations = sorted({int(i) for _, _, d in parts for i in d})
    x = np.asarray(iterations, dtype=float)
    stacks = [np.asarray([d.get(float(i), 0.0) for i in iterations]) for _, _, d in parts]
    fig, ax = _figure("Time per iteration", ylabel="seconds")
    ax.stackplot(x, stacks, labels=[label for _, label, _ in parts], alpha=0.85)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))  # outside: the stack fills the axes
    return Plot("time", "Time per iteration", _png(fig))


def plot_entropy_kl(rows: Sequence[dict[str, Any]]) -> Plot | None:
    ex, ey = series(rows, "train/entropy")
    kx, ky = series(rows, "train/kl")
    if not len(ex) and not len(kx):
        return None
    fig, ax = _figure("Entropy and KL", ylabel="entropy")
    handles = []
    if len(ex):
        handles += ax.plot(ex, ey, color="tab:blue", label="entropy", linewidth=1.2)
    if len(kx):
        # KL is orders of magnitude smaller than entropy: its own axis keeps both readable.
        ax2 = ax.twinx()
        ax2.set_ylabel("KL")
        handles += ax2.plot(kx, ky, color="tab:red", label="KL", linewidth=1.2)
    ax.legend(handles=handles, loc="best")
    return Plot("entropy_kl", "Entropy and KL", _png(fig))


def plot_eval_frontier(entries: Sequence[dict[str, Any]]) -> tuple[Plot | None, str]:
    """Accuracy against ln(cost per problem); tokens per problem stand in when costs are unknown."""
    if not entries:
        return None, ""
    costs = [e["cost"] for e in entries]
    if all(isinstance(c, int | float) and c > 0 for c in costs):
        xlabel, xs = "ln(estimated cost per problem)", [math.log(c) for c in costs]
    else:
        tokens = [e["tokens"] for e in entries]
        if not all(isinstance(t, int | float) and t > 0 for t in tokens):
            return None, "no positive cost_per_problem or tokens_per_problem for every model"
        xlabel, xs = "ln(tokens per problem)  (no prices set: tokens stand in for cost)", [
            math.log(t) for t in tokens]
    ys = [e["accuracy"] for e in entries]
    title = "Accuracy against cost"
    fig, ax = _figure(title, xlabel=xlabel, ylabel="accuracy (avg@k)")
    errs = [e["se"] if isinstance(e["se"], int | float) else 0.0 for e in entries]
    ax.errorbar(xs, ys, yerr=errs, fmt="o", capsize=3, label="model")
    for x, y, e in zip(xs, ys, entries):
        ax.annotate(e["model"], (x, y), textcoords="offset points", xytext=(5, 5), fontsize=8)
    front = pareto_frontier(xs, ys)
    ax.plot([xs[i] for i in front], [ys[i] for i in front], "--", color="tab:green", label="frontier")
    ax.legend(loc="best")
    return Plot("eval_frontier", title, _png(fig)), ""


KIND_ORDER = ("who", "weapon", "where", "when", "why", "bonus")


def plot_kinds(rows: Sequence[dict[str, Any]]) -> Plot | None:
    """Held-out accuracy per question kind (val/kind/KIND, Task.kind_scores) over the run: one
    curve per kind from the evaluations before, during (loop.eval_every) and after training."""
    kinds = sorted({k.removeprefix("val/kind/") for r in rows for k in r if k.startswith("val/kind/")},
                   key=lambda k: (KIND_ORDER.index(k) if k in KIND_ORDER else len(KIND_ORDER), k))
    return _lines_plot(rows, "kinds", "Held-out accuracy per question kind",
                       [(f"val/kind/{k}", k) for k in kinds], "accuracy")


def run_plots(run: RunData) -> tuple[list[Plot], tuple[float, float] | None]:
    rows = run.metrics
    power, fit = plot_power_law(rows)
    candidates = [
        plot_reward(rows),
        plot_reward_time(rows),
        plot_kinds(rows),
        power,
        _lines_plot(rows, "completion_len", "Completion length",
                    [("rollout/completion_tokens_mean", "mean"), ("completion_len_mean", "mean"),
                     ("completion_len_max", "max")], "tokens"),
        plot_entropy_kl(rows),
        _lines_plot(rows, "clip_frac", "Clip fractions",
                    [("train/clip_frac_low", "clipped low (ratio < 1 - clip_low)"),
                     ("train/clip_frac_high", "clipped high (ratio > 1 + clip_high)")], "fraction of tokens"),
        _lines_plot(rows, "loss", "Loss and gradient norm", [("train/loss", "loss"), ("train/grad_norm", "grad norm")]),
        plot_time(rows),
    ]
    return [p for p in candidates if p is not None], fit


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
    plots, fit = run_plots(run) if run else ([], None)
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
