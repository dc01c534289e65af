"""The plots of `sleuth report`: one PNG per curve of a run's metrics rows, and the cost-accuracy
frontier of `sleuth eval` summaries (sleuth.eval.report reads the inputs and writes report.html).

    plots, fit = run_plots(rows)      # rows: metrics.jsonl objects, as sleuth.eval.report.load_run reads them

Every key but "iteration" is optional in a row: a plot whose keys hold no finite number is left out.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

VAL_KEYS = ("val/reward", "val/accuracy")
TIME_PARTS = (("time/rollout_s", "generation"), ("time/score_s", "scoring"), ("time/train_s", "training"),
              ("time/sync_s", "weight sync"), ("time/eval_s", "evaluation"))


@dataclass
class Plot:
    name: str
    title: str
    png: bytes
    note: str = ""


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


def run_plots(rows: Sequence[dict[str, Any]]) -> tuple[list[Plot], tuple[float, float] | None]:
    """Every plot a run's metrics rows (metrics.jsonl) have data for, and the power-law fit."""
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
