"""A run's progress, one row per committed iteration, read from the committed manifests: what
`grpo report` plots, the flow's progress artifact shows and experiment trackers receive.

    grpo report --run demo     # report.png and report.md in the run folder

Each iteration's figures come from the newest committed attempt of each stage, so a resumed or
rerun iteration has one row with the values that were committed, whoever ran it.
"""

from __future__ import annotations

import io

from grpo.errors import StageError
from grpo.layout import run_dir, stage_dir
from grpo.query import iterations
from grpo.storage import NotCommittedError, Storage, latest_committed

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


PLOTS = [  # (title, row keys)
    ("mean reward", ["reward_mean"]),
    ("held-out eval", ["eval_exact_match", "eval_reward"]),
    ("KL to the reference", ["kl"]),
    ("clip fraction", ["clip_frac"]),
    ("entropy", ["entropy"]),
    ("response length (tokens)", ["response_length"]),
]


def figure_png(rows: list[dict], title: str, dpi: int = 90) -> bytes:
    """The PLOTS against iteration, as PNG bytes (matplotlib, no display); 12 x 6.5 inches at `dpi`."""
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
            ys = [r.get(key) for r in rows]
            if any(y is not None for y in ys):
                ax.plot(
                    x, [float("nan") if y is None else y for y in ys], marker="." if len(x) < 30 else None, label=key
                )
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
    storage.write_bytes_atomic(  # replaced whole: a reader or a crash never sees half a file
        png, figure_png(rows, f"run {run_id}: iterations {rows[0]['iteration']}..{rows[-1]['iteration']}")
    )
    last = rows[-1]
    text = (
        f"# Run {run_id}\n\n"
        f"{len(rows)} iterations; at iteration {last['iteration']}: mean reward {last['reward_mean']:.4g}, "
        f"held-out exact match {last['eval_exact_match']:.4g}.\n\n![progress](report.png)\n\n"
        f"{markdown_table(rows)}\n"
    )
    storage.write_bytes_atomic(md, text.encode())
    return storage.uri(png), storage.uri(md)
