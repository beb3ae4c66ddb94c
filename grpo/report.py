"""A run's progress, one row per committed iteration, read from the committed manifests: what
`grpo report` plots, the flow's progress artifact shows and experiment trackers receive.

    grpo report --run demo     # report.png and report.md in the run folder

Each iteration's figures come from the newest committed attempt of each stage, so a resumed or
rerun iteration has one row with the values that were committed, whoever ran it.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass

from grpo.config import load_config
from grpo.errors import StageError
from grpo.fork import fork_of
from grpo.layout import run_dir, run_json, stage_dir
from grpo.query import iterations
from grpo.storage import NotCommittedError, Storage, committed_attempts, latest_committed, load_manifest

# (row key, stage, summary key): reward and eval first
COLUMNS = [
    ("reward_mean", "advantages", "reward_mean"),
    ("eval_exact_match", "eval", "exact_match"),
    ("eval_reward", "eval", "reward_mean"),
    ("reward_std", "advantages", "reward_std"),
    ("kl", "learn", "kl"),
    ("clip_frac", "learn", "clip_frac"),
    ("entropy", "learn", "entropy"),
    ("loss", "learn", "loss"),
    ("grad_norm", "learn", "grad_norm"),
    ("logprob_gap", "learn", "logprob_gap"),
    ("stop_fraction", "rollouts", "stop_fraction"),
    ("samples", "advantages", "samples"),
]


def iteration_rows(storage: Storage, run_id: str, skip: set[int] | frozenset = frozenset()) -> list[dict]:
    """{iteration, <COLUMNS>, response_length, avg@k / pass@k (when sampled)} per iteration with a
    committed eval, ascending."""
    rows = []
    for k in iterations(storage, run_id):
        if k in skip:  # not read at all: a tracker that sent them needs none of their manifests
            continue
        try:
            s = {
                stage: latest_committed(storage, stage_dir(storage, run_id, k, stage), verify=False).manifest.summary
                for stage in ("rollouts", "advantages", "learn", "eval")
            }
        except NotCommittedError:
            continue
        row = {"iteration": k, **{key: s[stage].get(name) for key, stage, name in COLUMNS}}
        row["response_length"] = s["rollouts"]["response_tokens"] / max(s["rollouts"]["samples"], 1)
        row.update({key: v for key, v in s["eval"].items() if key.startswith(("avg@", "pass@"))})
        rows.append(row)
    return rows


@dataclass(frozen=True)
class Best:
    """The best iteration so far: the highest eval.metric among committed evals (skipped ones have none)."""

    iteration: int
    metric: str
    """eval.metric as the eval summary names it (config.EvalConfig.metric_key): exact_match, avg@4, ..."""
    value: float

    def __str__(self) -> str:
        return f"iteration {self.iteration} ({self.metric} {self.value:.4g})"


def eval_metric(storage: Storage, run_id: str) -> str:
    """The run's eval.metric as the eval summary names it (read from run.json alone)."""
    return load_config(json.loads(storage.read_bytes(run_json(storage, run_id)))["config"]).eval.metric_key


def best_iteration(storage: Storage, run_id: str, among: list[int] | None = None) -> Best | None:
    """The iteration (of `among`, default every one) whose newest committed eval has the highest eval.metric;
    ties: the higher eval mean reward, then the later iteration. None before the first eval that ran."""
    metric, scores = eval_metric(storage, run_id), {}
    for k in iterations(storage, run_id) if among is None else among:
        attempts = committed_attempts(storage, stage_dir(storage, run_id, k, "eval"))
        summary = load_manifest(storage, attempts[-1], verify=False)[0].summary if attempts else {}
        if isinstance(summary.get(metric), (int, float)):
            scores[k] = (summary[metric], summary.get("reward_mean") or 0.0, k)
    if not scores:
        return None
    k = max(scores, key=scores.__getitem__)
    return Best(k, metric, float(scores[k][0]))


PLOTS = [  # (title, row keys)
    ("mean reward", ["reward_mean"]),
    ("held-out eval", ["eval_exact_match", "eval_reward"]),
    ("KL to the reference", ["kl"]),
    ("clip fraction", ["clip_frac"]),
    ("entropy", ["entropy"]),
    ("response length (tokens)", ["response_length"]),
]


def figure_png(rows: list[dict], title: str, dpi: int = 90, best: Best | None = None) -> bytes:
    """The PLOTS against iteration, as PNG bytes (matplotlib, no display); 12 x 6.5 inches at `dpi`; the best
    iteration a dashed line on the held-out eval's plot. Iterations without a figure (a skipped eval) are
    left out of that figure's line."""
    return _figure({"": rows}, title, dpi, best=best)


def compare_png(runs: dict[str, list[dict]], title: str, forks: dict[str, int], dpi: int = 90) -> bytes:
    """figure_png with one line per run (and figure) in each plot, overlaid (`grpo report --compare`); a fork's
    fork point (`forks`: {run: iteration}) a dotted line."""
    return _figure(runs, title, dpi, forks=forks)


def _figure(
    runs: dict[str, list[dict]], title: str, dpi: int, best: Best | None = None, forks: dict[str, int] | None = None
) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(2, 3, figsize=(12, 6.5), constrained_layout=True)
    for ax, (name, keys) in zip(axes.flat, PLOTS):
        if all(
            r.get(key) is None for rows in runs.values() for r in rows for key in keys
        ):  # the KL without a reference
            ax.text(0.5, 0.5, "not measured\n(learn.kl_coef = 0)", ha="center", va="center", transform=ax.transAxes)
        for run, rows in runs.items():
            for key in keys:
                xy = [(r["iteration"], r[key]) for r in rows if r.get(key) is not None]
                label = " ".join(x for x in (run, key if len(keys) > 1 or not run else "") if x)
                if xy:
                    ax.plot(*zip(*xy), marker="." if len(xy) < 30 else None, label=label)
        if best is not None and "eval_exact_match" in keys:
            ax.axvline(best.iteration, color="gray", linestyle="--", linewidth=1, label=f"best: {best}")
        for at in (forks or {}).values():
            ax.axvline(at, color="gray", linestyle=":", linewidth=1)
        ax.set_title(name)
        ax.set_xlabel("iteration")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # iterations are whole numbers
        ax.grid(alpha=0.3)
        if (len(keys) > 1 or len(runs) > 1) and ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(title)
    out = io.BytesIO()
    fig.savefig(out, format="png", dpi=dpi)
    plt.close(fig)
    return out.getvalue()


def headline(rows: list[dict], best: Best | None) -> str:
    """`N iterations; at iteration k: mean reward r, held-out exact match e (of iteration j, the last evaluated).
    Best so far: iteration b (exact_match 0.81).`"""
    last = rows[-1]
    text = f"{len(rows)} iterations; at iteration {last['iteration']}: mean reward {last['reward_mean']:.4g}"
    evaluated = [r for r in rows if r.get("eval_exact_match") is not None]
    if evaluated:
        e = evaluated[-1]
        of = "" if e is last else f" (of iteration {e['iteration']}, the last evaluated)"
        text += f", held-out exact match {e['eval_exact_match']:.4g}{of}"
    return text + (f". Best so far: {best}." if best is not None else ". No eval has run yet (eval.every).")


def markdown_table(rows: list[dict], keys: list[str] | None = None) -> str:
    keys = keys or list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in rows:
        cells = [f"{r.get(k):.4g}" if isinstance(r.get(k), float) else str(r.get(k, "")) for k in keys]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_report(storage: Storage, run_id: str, rows: list[dict] | None = None) -> tuple[str, str]:
    """Write report.png and report.md into the run folder; returns their URIs."""
    rows = iteration_rows(storage, run_id) if rows is None else rows  # the caller's, when it has them
    if not rows:
        raise StageError(f"run {run_id}: no iteration has a committed eval yet; run one (`grpo run --run {run_id}`)")
    rdir = run_dir(storage, run_id)
    png, md = f"{rdir}/report.png", f"{rdir}/report.md"
    best = best_iteration(storage, run_id, [r["iteration"] for r in rows])
    storage.write_bytes_atomic(  # replaced whole: a reader or a crash never sees half a file
        png, figure_png(rows, f"run {run_id}: iterations {rows[0]['iteration']}..{rows[-1]['iteration']}", best=best)
    )
    fork = fork_of(storage, run_id)
    lineage = (
        f"A fork of run {fork['parent']} at iteration {fork['at']}: iterations before {fork['at']} are "
        f"{fork['parent']}'s, by reference (`grpo fork`).\n\n"
        if fork
        else ""
    )
    text = f"# Run {run_id}\n\n{lineage}{headline(rows, best)}\n\n![progress](report.png)\n\n{markdown_table(rows)}\n"
    storage.write_bytes_atomic(md, text.encode())
    return storage.uri(png), storage.uri(md)


def write_compare(storage: Storage, run_id: str, others: list[str]) -> tuple[str, str]:
    """`grpo report --run A --compare B C`: compare.png (every run's curves overlaid, a fork's fork point
    dotted) and compare.md (each run's last figures and best iteration) in run A's folder; returns their URIs."""
    runs = {r: iteration_rows(storage, r) for r in dict.fromkeys([run_id, *others])}
    if empty := [r for r, rows in runs.items() if not rows]:
        raise StageError(
            f"run {empty[0]}: no iteration has a committed eval yet; run one (`grpo run --run {empty[0]}`)"
        )
    forks = {r: f["at"] for r in runs if (f := fork_of(storage, r)) is not None}
    rdir = run_dir(storage, run_id)
    png, md = f"{rdir}/compare.png", f"{rdir}/compare.md"
    storage.write_bytes_atomic(png, compare_png(runs, f"runs {', '.join(runs)}", forks))
    lines = [f"# Runs {', '.join(runs)}", "", "![compare](compare.png)", ""]
    for r, rows in runs.items():
        best = best_iteration(storage, r, [row["iteration"] for row in rows])
        lineage = f" (a fork of {fork_of(storage, r)['parent']} at iteration {forks[r]})" if r in forks else ""
        lines += [f"- {r}{lineage}: {headline(rows, best)}"]
    storage.write_bytes_atomic(md, ("\n".join(lines) + "\n").encode())
    return storage.uri(png), storage.uri(md)
