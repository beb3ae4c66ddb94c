"""A run's progress, one row per committed iteration, read from the committed manifests: what
`grpo report` plots, the flow's progress artifact shows and experiment trackers receive.

    grpo report --run demo     # report.png, io.png (bytes per stage) and report.md in the run folder

Each iteration's figures come from the newest committed attempt of each stage, so a resumed or
rerun iteration has one row with the values that were committed, whoever ran it.
"""

from __future__ import annotations

import datetime as dt
import io
import json
import re

from grpo.errors import StageError
from grpo.query import (  # noqa: F401 (Best, eval_metric: read here by callers)
    Best,
    best_iteration,
    eval_metric,
    io_rows,
    iterations,
)
from grpo.record.fork import fork_of
from grpo.record.identity import stored_config
from grpo.record.layout import OPTIONAL_STAGES, STAGES, STATE_STAGE, run_dir, run_json, stage_dir
from grpo.record.storage import (
    Committed,
    NotCommittedError,
    Storage,
    committed_attempts,
    latest_committed,
    load_manifest,
)
from schemas import table_file

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
    ("behavior_weight_mean", "learn", "behavior_weight_mean"),
    ("behavior_weight_max", "learn", "behavior_weight_max"),
    ("behavior_clipped_frac", "learn", "behavior_clipped_frac"),
    ("sampler_kl", "learn", "sampler_kl"),
    ("stop_fraction", "rollouts", "stop_fraction"),
    ("samples", "advantages", "samples"),
    ("turns_per_episode", "rollouts", "turns_per_episode"),  # episodes (rollout.tools, rollout.environment)
    ("tool_calls", "rollouts", "tool_calls"),
    ("tool_errors", "rollouts", "tool_errors"),
    ("responses_carried", "rollouts", "responses_carried"),  # partial rollouts (rollout.segment_tokens)
    ("responses_finished", "rollouts", "responses_finished"),
    ("responses_waiting", "rollouts", "responses_waiting"),
    ("groups_released", "rollouts", "groups_released"),
    ("released_age_mean", "rollouts", "released_age_mean"),
    ("oldest_age", "rollouts", "oldest_age"),
]


_REFERENCE = re.compile(r"/iter-(\d+)/snapshot/")  # a learn's reference input: an iteration's snapshot, else the base


def iteration_rows(storage: Storage, run_id: str, skip: set[int] | frozenset = frozenset()) -> list[dict]:
    """{iteration, <COLUMNS>, response_length, lr, iteration_s, rollouts_s, learn_s, reference_iteration,
    avg@k / pass@k (when sampled)} per iteration with a committed eval, ascending.

    lr: the learning rate of the iteration's last optimizer step (its learn_metrics table); iteration_s: seconds
    from start to commit of its six stages, added (rollouts_s, learn_s: of those two; None for a stage a fork took
    by reference, which ran in another run, and iteration_s None where any did); reference_iteration: the
    iteration whose snapshot the learn's KL reference was (learn.ref_update_every), None for the base model.
    sampler_kl: a k3 estimate, never below 0 (round-off made one -8.8e-12)."""
    rows = []
    for k in iterations(storage, run_id):
        if k in skip:  # not read at all: a tracker that sent them needs none of their manifests
            continue
        try:
            c = {
                stage: latest_committed(storage, stage_dir(storage, run_id, k, stage), verify=False) for stage in STAGES
            }
        except NotCommittedError:
            continue
        s = {stage: c[stage].manifest.summary for stage in STAGES}
        row = {"iteration": k, **{key: s[stage].get(name) for key, stage, name in COLUMNS}}
        row["response_length"] = s["rollouts"]["response_tokens"] / max(s["rollouts"]["samples"], 1)
        row.update({key: v for key, v in s["eval"].items() if key.startswith(("avg@", "pass@"))})
        row["lr"] = last_lr(storage, c["learn"])
        seconds = {stage: None if c[stage].manifest.origin else _seconds(c[stage].manifest) for stage in STAGES}
        ran_here = None not in seconds.values()
        row.update(iteration_s=sum(seconds.values()) if ran_here else None, rollouts_s=seconds["rollouts"])
        row.update(learn_s=seconds["learn"])
        if row.get("sampler_kl") is not None:
            row["sampler_kl"] = max(row["sampler_kl"], 0.0)
        reference = c["learn"].manifest.inputs.get("reference")
        found = _REFERENCE.search(reference.uri) if reference is not None else None
        row["reference_iteration"] = int(found.group(1)) if found else None
        if taught := committed_attempts(storage, stage_dir(storage, run_id, k, "teacher")):  # on-policy distillation
            row["teacher_kl"] = load_manifest(storage, taught[-1], verify=False)[0].summary.get("reverse_kl")
        rows.append(row)
    return rows


def last_lr(storage: Storage, learn: Committed) -> float | None:
    """The learning rate of a committed learn's last optimizer step (None: it took none); read once a process (a
    committed file never changes), as the flow's progress artifact reads every iteration's again and again."""
    key = (learn.uri, learn.manifest_sha256)
    if key not in _LAST_LR:
        from schemas import read_parquet

        lrs = read_parquet(storage.fs, learn.path(table_file("learn_metrics")), "learn_metrics", columns=["lr"])
        _LAST_LR[key] = lrs.column("lr")[-1].as_py() if lrs.num_rows else None
    return _LAST_LR[key]


_LAST_LR: dict[tuple[str, str], float | None] = {}


def _seconds(manifest) -> float:
    """From an attempt's start to its commit."""
    return (
        dt.datetime.fromisoformat(manifest.committed_at) - dt.datetime.fromisoformat(manifest.started_at)
    ).total_seconds()


PLOTS = [  # (title, row keys); a plot with no value in any row (KL with learn.kl_coef 0) is left out
    ("mean reward", ["reward_mean"]),
    ("held-out eval", ["eval_exact_match", "eval_reward"]),
    ("loss", ["loss"]),
    ("grad norm (before clipping)", ["grad_norm"]),
    ("learning rate", ["lr"]),
    ("KL to the reference", ["kl"]),
    ("clip fraction", ["clip_frac"]),
    ("entropy", ["entropy"]),
    ("response length (tokens)", ["response_length"]),
    ("wall time per iteration (s)", ["iteration_s", "rollouts_s", "learn_s"]),
    # the sampler against the learner (rollout.staleness, learn.behavior_correction): weights pi_prox / pi_sampler
    (
        "behaviour weights, sampler KL",  # BEHAVIOR
        ["behavior_weight_mean", "behavior_weight_max", "behavior_clipped_frac", "sampler_kl"],
    ),
    # episodes (rollout.tools, rollout.environment): the rollouts' summary, the turns table per iteration
    ("turns per episode", ["turns_per_episode"]),
    ("tool calls and tool errors", ["tool_calls", "tool_errors"]),
    # partial rollouts (rollout.segment_tokens): the rollouts' summary, what each iteration carried and finished
    ("responses carried, finished, waiting", ["responses_carried", "responses_finished", "responses_waiting"]),
    ("age of released groups, oldest held (iterations)", ["released_age_mean", "oldest_age"]),
]
COLUMNS_PER_ROW = 4


def reference_refreshes(rows: list[dict]) -> list[int]:
    """Iterations whose KL reference is another than the row before's (learn.ref_update_every: the KL drops there).

    >>> rows = [{"iteration": k, "reference_iteration": None if k < 2 else 2 * (k // 2)} for k in range(5)]
    >>> reference_refreshes(rows)
    [2, 4]
    """
    pairs = zip(rows, rows[1:])
    return [b["iteration"] for a, b in pairs if a.get("reference_iteration") != b.get("reference_iteration")]


BEHAVIOR = "behaviour weights, sampler KL"  # PLOTS' panel of the sampler against the learner


def shown_plots(rows: list[dict], behavior: bool = True) -> list[tuple[str, list[str]]]:
    """The PLOTS with a value in some row; the behaviour panel only with `behavior` (behavior_drawn)."""
    shown = [(name, keys) for name, keys in PLOTS if any(r.get(key) is not None for r in rows for key in keys)]
    return [(name, keys) for name, keys in shown if behavior or name != BEHAVIOR]


def behavior_drawn(storage: Storage, run_id: str) -> bool:
    """Whether a run's report draws the behaviour panel: it samples stale policies (rollout.staleness) or corrects
    for the sampler (learn.behavior_correction); with neither, its weights sit at 1 and say nothing."""
    cfg = stored_config(json.loads(storage.read_bytes(run_json(storage, run_id)))["config"])
    return cfg.rollout.staleness > 0 or cfg.learn.behavior_correction != "none"


def figure_png(rows: list[dict], title: str, dpi: int = 90, best: Best | None = None, behavior: bool = True) -> bytes:
    """The report's figure (`figure`) as PNG bytes at `dpi`."""
    return _png(figure(rows, title, best, behavior=behavior), dpi)


def compare_png(
    runs: dict[str, list[dict]], title: str, forks: dict[str, int], dpi: int = 90, behavior: bool = True
) -> bytes:
    """The figure with one line per run (and figure) in each plot, overlaid (`grpo report --compare`); a fork's
    fork point (`forks`: {run: iteration}) a dotted line."""
    return _png(figure(runs, title, forks=forks, behavior=behavior), dpi)


def _png(fig, dpi: int) -> bytes:
    from matplotlib import pyplot as plt

    out = io.BytesIO()
    fig.savefig(out, format="png", dpi=dpi)
    plt.close(fig)
    return out.getvalue()


def figure(
    runs: list[dict] | dict[str, list[dict]],
    title: str,
    best: Best | None = None,
    forks: dict[str, int] | None = None,
    behavior: bool = True,
):
    """The PLOTS against iteration, a matplotlib Figure (no display; close it with pyplot.close), 4 plots a row,
    every x axis spanning the same iterations (an eval under eval.every has points on some of them); `runs`: one
    run's rows, or {run: rows} overlaid. The best iteration a dashed line on the held-out eval's plot unless every
    eval scored 0, reference refreshes dotted lines on the KL's (one run), fork points dotted lines. Iterations
    without a figure (a skipped eval) are left out of that figure's line."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.ticker import MaxNLocator

    runs = {"": runs} if isinstance(runs, list) else runs
    every = [r for rows in runs.values() for r in rows]
    plots = shown_plots(every, behavior)
    nrows = -(-len(plots) // COLUMNS_PER_ROW)
    fig, axes = plt.subplots(
        nrows, COLUMNS_PER_ROW, figsize=(16, 3.2 * nrows + 0.4), constrained_layout=True, squeeze=False
    )
    x = [r["iteration"] for r in every]
    for ax in axes.flat[len(plots) :]:
        ax.set_visible(False)
    for ax, (name, keys) in zip(axes.flat, plots):
        for run, rows in runs.items():
            for key in keys:
                xy = [(r["iteration"], r[key]) for r in rows if r.get(key) is not None]
                label = " ".join(part for part in (run, key if len(keys) > 1 or not run else "") if part)
                if xy:
                    ax.plot(*zip(*xy), marker="." if len(xy) < 30 else None, label=label)
        if best is not None and not best.all_zero and "eval_exact_match" in keys:
            ax.axvline(best.iteration, color="gray", linestyle="--", linewidth=1, label=f"best: {best}")
        if "sampler_kl" in keys:
            ax.set_yscale("symlog", linthresh=1e-3)  # a KL of 1e-4 beside weights near 1
        if "kl" in keys and len(runs) == 1:
            for i, k in enumerate(reference_refreshes(every)):
                ax.axvline(k, color="tab:red", linestyle=":", linewidth=1, label=None if i else "reference refresh")
        for at in (forks or {}).values():
            ax.axvline(at, color="gray", linestyle=":", linewidth=1)
        ax.set_title(name)
        ax.set_xlabel("iteration")
        ax.set_xlim(min(x) - 0.5, max(x) + 0.5)  # the same span on every plot
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # iterations are whole numbers
        ax.grid(alpha=0.3)
        if len(ax.get_legend_handles_labels()[0]) > 1:
            ax.legend(fontsize=8)
    fig.suptitle(title)
    return fig


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
    if best is None:
        return text + ". No eval has run yet (eval.every)."
    if best.all_zero:
        return text + f". Every eval so far scored {best.metric} 0: none is best yet."
    return text + f". Best so far: {best}."


def markdown_table(rows: list[dict], keys: list[str] | None = None) -> str:
    """A row per iteration; numbers to 4 significant digits, `-` where an iteration has none (a skipped eval);
    by default every key of the rows that some row has a value for.

    >>> print(markdown_table([{"iteration": 0, "kl": 0.0, "lr": None}, {"iteration": 1, "kl": 1.5e-05, "lr": None}]))
    | iteration | kl |
    |---|---|
    | 0 | 0 |
    | 1 | 1.5e-05 |
    """
    keys = keys or [k for k in dict.fromkeys(k for r in rows for k in r) if any(r.get(k) is not None for r in rows)]
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in rows:
        cells = [_cell(r.get(k)) for k in keys]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(v) -> str:
    return "-" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)


def write_report(storage: Storage, run_id: str, rows: list[dict] | None = None) -> tuple[str, str]:
    """Write report.png and report.md into the run folder; returns their URIs."""
    rows = iteration_rows(storage, run_id) if rows is None else rows  # the caller's, when it has them
    if not rows:
        raise StageError(f"run {run_id}: no iteration has a committed eval yet; run one (`grpo run --run {run_id}`)")
    rdir = run_dir(storage, run_id)
    png, md = f"{rdir}/report.png", f"{rdir}/report.md"
    best = best_iteration(storage, run_id, [r["iteration"] for r in rows])
    behavior = behavior_drawn(storage, run_id)
    storage.write_bytes_atomic(  # replaced whole: a reader or a crash never sees half a file
        png,
        figure_png(
            rows,
            f"run {run_id}: iterations {rows[0]['iteration']}..{rows[-1]['iteration']}",
            best=best,
            behavior=behavior,
        ),
    )
    hidden = set() if behavior else set(dict(PLOTS)[BEHAVIOR])  # weights at 1 say nothing: as the figure
    fork = fork_of(storage, run_id)
    lineage = (
        f"A fork of run {fork['parent']} at iteration {fork['at']}: iterations before {fork['at']} are "
        f"{fork['parent']}'s, by reference (`grpo fork`).\n\n"
        if fork
        else ""
    )
    shown = [{k: v for k, v in r.items() if k not in hidden} for r in rows]
    text = f"# Run {run_id}\n\n{lineage}{headline(rows, best)}\n\n![progress](report.png)\n\n{markdown_table(shown)}\n"
    if (moved := io_png(storage, run_id)) is not None:  # bytes per stage per iteration, from the manifests
        storage.write_bytes_atomic(f"{rdir}/io.png", moved)
        text += "\n![bytes through storage per stage](io.png)\n"
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
    behavior = any(behavior_drawn(storage, r) for r in runs)
    storage.write_bytes_atomic(png, compare_png(runs, f"runs {', '.join(runs)}", forks, behavior=behavior))
    lines = [f"# Runs {', '.join(runs)}", "", "![compare](compare.png)", ""]
    for r, rows in runs.items():
        best = best_iteration(storage, r, [row["iteration"] for row in rows])
        lineage = f" (a fork of {fork_of(storage, r)['parent']} at iteration {forks[r]})" if r in forks else ""
        lines += [f"- {r}{lineage}: {headline(rows, best)}"]
    lines += ["", side_by_side(runs)]
    storage.write_bytes_atomic(md, ("\n".join(lines) + "\n").encode())
    return storage.uri(png), storage.uri(md)


def side_by_side(runs: dict[str, list[dict]], keys: tuple[str, ...] = ("reward_mean", "eval_exact_match")) -> str:
    """compare.md's table: a row per iteration, each run's figures side by side (`-` where a run has no such
    iteration, or no eval there).

    >>> print(side_by_side({"a": [{"iteration": 0, "reward_mean": 0.5, "eval_exact_match": None}], "b": []}))
    | iteration | a reward_mean | b reward_mean | a eval_exact_match | b eval_exact_match |
    |---|---|---|---|---|
    | 0 | 0.5 | - | - | - |
    """
    by_run = {r: {row["iteration"]: row for row in rows} for r, rows in runs.items()}
    its = sorted({k for rows in by_run.values() for k in rows})
    table = [
        {"iteration": k} | {f"{r} {key}": by_run[r].get(k, {}).get(key) for key in keys for r in runs} for k in its
    ]
    columns = ["iteration"] + [f"{r} {key}" for key in keys for r in runs]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(_cell(row[c]) for c in columns) + " |" for row in table])


SAMPLER_SIDE = ("snapshot", "rollouts", "rewards", "advantages", "eval")  # the stages that sample or score


def stage_times(storage: Storage, run_id: str) -> list[dict]:
    """The timeline of a run from its manifests: per iteration and stage (the newest committed attempt), its start
    and commit in seconds since the run's first stage started, in start order; the learner's state commits
    (STATE_STAGE) too, made beside the next stages. Attempts taken by reference (a fork's) are left out: they ran
    in another run. A placed stage (grpo.record.dispatches) also has `sent`: when the flow sent it off, so that from
    `sent` to `start` it waited for its process (a worker taking its flow run, the process starting), not working."""
    from grpo.record.dispatches import sent_times

    out, sent = [], sent_times(storage, run_id)
    for k in iterations(storage, run_id):
        for stage in (*STAGES, *OPTIONAL_STAGES, STATE_STAGE):
            attempts = committed_attempts(storage, stage_dir(storage, run_id, k, stage))
            manifest = load_manifest(storage, attempts[-1], verify=False)[0] if attempts else None
            if manifest is None or manifest.origin is not None or manifest.summary.get("skipped"):
                continue
            start, end = (dt.datetime.fromisoformat(t) for t in (manifest.started_at, manifest.committed_at))
            row = {"iteration": k, "stage": stage, "start": start, "end": end}
            if (k, stage) in sent and sent[k, stage] <= start:  # sent off, then started: not a reuse
                row["sent"] = sent[k, stage]
            out.append(row)
    if not out:
        return []
    zero = min(r.get("sent", r["start"]) for r in out)
    rows = [r | {t: (r[t] - zero).total_seconds() for t in ("sent", "start", "end") if t in r} for r in out]
    return sorted(rows, key=lambda r: (r["start"], r["iteration"]))


def overlaps(rows: list[dict]) -> list[int]:
    """Iterations k whose learn ran while iteration k+1 sampled (rollout.staleness, learn placed on its own).

    >>> rows = [{"iteration": 0, "stage": "learn", "start": 5, "end": 9}, {"iteration": 1, "stage": "rollouts",
    ...         "start": 6, "end": 8}, {"iteration": 1, "stage": "learn", "start": 9, "end": 12}]
    >>> overlaps(rows)
    [0]
    """
    learn = {r["iteration"]: r for r in rows if r["stage"] == "learn"}
    sampled = {r["iteration"]: r for r in rows if r["stage"] == "rollouts"}
    return [k for k, r in sorted(learn.items()) if k + 1 in sampled and sampled[k + 1]["start"] < r["end"]]


def timeline_png(rows: list[dict], title: str, dpi: int = 90) -> bytes:
    """A bar per stage attempt on a lane per stage against wall-clock seconds, labelled with its iteration: where
    the sampling side (snapshot to advantages, eval) and the learner overlap, and where each lane idles."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    lanes = [s for s in (*STAGES, *OPTIONAL_STAGES, STATE_STAGE) if any(r["stage"] == s for r in rows)]
    fig, ax = plt.subplots(figsize=(12, 0.5 * len(lanes) + 1.2), constrained_layout=True)
    for r in rows:
        y = lanes.index(r["stage"])
        color = (
            "tab:orange"
            if r["stage"] in ("learn", STATE_STAGE)
            else "tab:blue"
            if r["stage"] in SAMPLER_SIDE
            else "gray"
        )
        if "sent" in r:  # a placed stage waiting for its flow run's process: start-up, not work
            startup = "start-up (placed: waiting for its process)"
            ax.broken_barh([(r["sent"], r["start"] - r["sent"])], (y - 0.25, 0.5), facecolor="none",
                           edgecolor=color, hatch="///", alpha=0.6, label=startup)  # fmt: skip
        ax.broken_barh([(r["start"], max(r["end"] - r["start"], 1e-3))], (y - 0.4, 0.8), color=color, alpha=0.8)
        ax.text(r["start"], y, str(r["iteration"]), va="center", fontsize=7)
    if any("sent" in r for r in rows):
        handles, labels = ax.get_legend_handles_labels()
        ax.legend(handles[:1], labels[:1], loc="lower right", fontsize=8)
    ax.set_yticks(range(len(lanes)), lanes)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the first stage started")
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(title)
    return _png(fig, dpi)


SEGMENT_KEYS = ("responses_carried", "responses_finished", "responses_waiting", "groups_released", "carried_ages",
                "released_ages")  # fmt: skip


def segment_rows(storage: Storage, run_id: str) -> list[dict]:
    """Per iteration whose rollouts committed with rollout.segment_tokens: the responses it carried on unfinished,
    finished, left waiting for their group, the groups it released, and their ages ({iterations since their group
    started: responses (carried) or groups (released)}); [] for a run without segments."""
    out = []
    for k in iterations(storage, run_id):
        attempts = committed_attempts(storage, stage_dir(storage, run_id, k, "rollouts"))
        summary = load_manifest(storage, attempts[-1], verify=False)[0].summary if attempts else {}
        if "responses_carried" in summary:
            out.append({"iteration": k, **{key: summary[key] for key in SEGMENT_KEYS}})
    return out


def write_timeline(storage: Storage, run_id: str) -> tuple[str, list[dict]]:
    """timeline.png in the run folder (`grpo timeline`); returns its URI and the rows."""
    rows = stage_times(storage, run_id)
    if not rows:
        raise StageError(f"run {run_id}: no stage has committed yet; run one (`grpo run --run {run_id}`)")
    png = f"{run_dir(storage, run_id)}/timeline.png"
    overlapped = overlaps(rows)
    title = f"run {run_id}: stages against time" + (
        f"; learn beside the next sampling at {overlapped}" * bool(overlapped)
    )
    storage.write_bytes_atomic(png, timeline_png(rows, title))
    return storage.uri(png), rows
