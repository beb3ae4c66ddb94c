"""A run's progress, one row per committed iteration, read from the committed manifests: what
`grpo report` plots, the flow's progress artifact shows and experiment trackers receive.

    grpo report --run demo     # report.png, io.png (bytes per stage) and report.md in the run folder

Each iteration's figures come from the newest committed attempt of each stage, so a resumed or
rerun iteration has one row with the values that were committed, whoever ran it.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass

from grpo.config import load_config
from grpo.errors import StageError
from grpo.layout import run_dir, run_json, stage_dir
from grpo.query import io_rows, iterations
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
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(2, 3, figsize=(12, 6.5), constrained_layout=True)
    x = [r["iteration"] for r in rows]
    for ax, (name, keys) in zip(axes.flat, PLOTS):
        if all(r.get(key) is None for r in rows for key in keys):  # the KL without a reference model
            ax.text(0.5, 0.5, "not measured\n(learn.kl_coef = 0)", ha="center", va="center", transform=ax.transAxes)
        for key in keys:
            xy = [(k, r[key]) for k, r in zip(x, rows) if r.get(key) is not None]
            if xy:
                ax.plot(*zip(*xy), marker="." if len(xy) < 30 else None, label=key)
        if best is not None and "eval_exact_match" in keys:
            ax.axvline(best.iteration, color="gray", linestyle="--", linewidth=1, label=f"best: {best}")
        ax.set_title(name)
        ax.set_xlabel("iteration")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # iterations are whole numbers
        ax.grid(alpha=0.3)
        if len(keys) > 1:
            ax.legend(fontsize=8)
    fig.suptitle(title)
    out = io.BytesIO()
    fig.savefig(out, format="png", dpi=dpi)
    plt.close(fig)
    return out.getvalue()


def io_png(storage: Storage, run_id: str, dpi: int = 90) -> bytes | None:
    """Bytes each stage moved through storage per iteration (read + downloaded + written + uploaded, from
    its manifest's io record), a line per stage on a log scale, and the bytes hashed in all; PNG bytes, None
    when no manifest has an io record."""
    counts = io_rows(storage, run_id).dropna(subset=["read_bytes", "iteration"])
    if counts.empty:
        return None
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.ticker import MaxNLocator

    counts["moved"] = counts[["read_bytes", "download_bytes", "write_bytes", "upload_bytes"]].sum(axis=1)
    counts["stage"] = counts["stage"].str.replace(r"-shard-.*", "", regex=True)  # a sharded stage: shards summed
    moved = counts.pivot_table(index="iteration", columns="stage", values="moved", aggfunc="sum")
    fig, ax = plt.subplots(figsize=(12, 4), constrained_layout=True)
    for stage in moved.columns:
        ax.plot(moved.index, moved[stage], marker=".", label=stage)
    hashed = counts.groupby("iteration")["hash_bytes"].sum()
    ax.plot(hashed.index, hashed.values, "k--", linewidth=1, label="hashed, all stages")
    ax.set(yscale="log", xlabel="iteration", ylabel="bytes", title="bytes through storage per stage (manifests' io)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=4)
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
    text = f"# Run {run_id}\n\n{headline(rows, best)}\n\n![progress](report.png)\n\n{markdown_table(rows)}\n"
    if (moved := io_png(storage, run_id)) is not None:  # bytes per stage per iteration, from the manifests
        storage.write_bytes_atomic(f"{rdir}/io.png", moved)
        text += "\n![bytes through storage per stage](io.png)\n"
    storage.write_bytes_atomic(md, text.encode())
    return storage.uri(png), storage.uri(md)
