"""First run to insight: the demo that learns, quiet output, the backend `auto` picks, the report
and experiment tracking (TensorBoard event files, an MLflow store and `mlflow ui` serving it)."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from flows.cli import main
from grpo.config import load_config
from grpo.record.storage import open_storage
from grpo.report import (
    Best,
    best_iteration,
    figure,
    headline,
    iteration_rows,
    markdown_table,
    reference_refreshes,
    write_report,
)
from grpo.sampling import engines
from grpo.tracking import event_dir
from stages.init import init_run
from stages.iteration import run_warm
from stages.learn import WARM

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "rollout.prompts_per_iteration=16",
    "rollout.group_size=4",
    "learn.minibatch_size=32",
    "learn.microbatch_size=16",
    "eval.n_prompts=16",
    "reward.workers=1",
]


@pytest.fixture
def storage(tmp_path):
    return open_storage((tmp_path / "store").as_uri())


def grpo(tmp_path, *args, timeout=600):
    """The CLI in a fresh process, as a user runs it: (exit code, stdout, stderr)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GRPO_", "VLLM_"))}
    proc = subprocess.run(
        [sys.executable, "-m", "flows.cli", "--storage", str(tmp_path / "storage"), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return proc.returncode, proc.stdout, proc.stderr


@pytest.mark.slow
def test_demo_learns_to_sort_printing_one_line_an_iteration_and_nothing_else(tmp_path):
    """The defaults are a recipe that learns: held-out exact match reaches 0.9, one line an iteration,
    then where the run lives and what to try next; nothing on stderr, nothing at exit."""
    code, out, err = grpo(tmp_path, "demo")
    assert code == 0 and err == "", err
    lines = out.splitlines()
    assert lines[0].startswith("training run demo (sort task, a tiny model built here) until held-out exact match")
    lines = lines[1:]
    assert lines[0].split() == ["iteration", "reward", "eval", "exact", "elapsed", "s"]
    table = [line.split() for line in lines[1:] if re.fullmatch(r"\s*\d+(\s+[\d.]+){3}", line)]
    assert [int(row[0]) for row in table] == list(range(len(table))) and len(table) <= 40
    assert float(table[-1][2]) >= 0.9 > max(float(row[2]) for row in table[:-1])  # stopped when it got there
    assert float(table[-1][1]) > float(table[0][1])  # mean reward rose
    rest = lines[1 + len(table) :]
    assert rest[0] == f"held-out exact match reached 0.9 at iteration {len(table) - 1}"
    assert rest[1] == f"run demo: {(tmp_path / 'storage' / 'runs' / 'demo').as_uri()}"
    grpo_again = f"{Path(sys.executable).with_name('grpo')} --storage {tmp_path / 'storage'}"  # as typed here
    assert [re.match(rf"(next:)? +{re.escape(grpo_again)} (\w+) --run demo", line).group(2) for line in rest[2:]] == [
        "status",
        "query",
        "report",
        "run",
        "export",
    ]


@pytest.mark.vllm
def test_a_vllm_run_prints_nothing_but_its_lines(tmp_path):
    small = ["--set", "model.hidden_size=64", "--set", "rollout.backend=vllm"]
    for kv in TINY:
        small += ["--set", kv]
    code, out, err = grpo(tmp_path, "demo", "--iterations", "1", *small)
    assert code == 0 and err == "", err  # no vLLM start-up lines, warnings or exit noise
    assert len(out.splitlines()) == 1 + 2 + 1 + 6  # what it does, header, one iteration, the verdict, where, next


def test_a_tracked_run_prints_nothing_but_its_lines(tmp_path):
    args = ["--set", "tracking.backend=mlflow", "--set", f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}"]
    for kv in TINY:
        args += ["--set", kv]
    code, out, err = grpo(tmp_path, "demo", "--iterations", "1", *args)
    assert code == 0 and err == "", err  # no MLflow INFO lines (its own handler logs them by default)


def test_auto_backend_picks_by_model_size_and_says_why(tmp_path, storage, monkeypatch):
    from safetensors.torch import save_file

    init_run(storage, "a", load_config(None, TINY))
    run = list(run_warm(storage, "a", 0, 1))[0][1]
    WARM.take(None)
    sampler = run["rollouts"].manifest.summary["sampler"]
    assert sampler["backend"] == "hf" and re.fullmatch(r"auto: 0\.\dM parameters on a CPU \(< 10M\)", sampler["why"])
    assert run["eval"].manifest.summary["sampler"]["backend"] == "hf"
    big = tmp_path / "big"
    big.mkdir()
    save_file({"w": torch.zeros(10_000_000, dtype=torch.bfloat16)}, str(big / "model.safetensors"))
    assert engines.choose_backend("auto", str(big)) == ("vllm", "auto: 10.0M parameters on a CPU (>= 10M)")
    assert engines.choose_backend("hf", str(big)) == ("hf", "rollout.backend")
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "vllm" else object())
    assert engines.choose_backend("auto", str(big)) == ("hf", "auto: vLLM is not installed")


def test_report_rows_cover_every_committed_iteration_and_the_plot_is_written(storage, tmp_path):
    init_run(storage, "r", load_config(None, TINY))
    first = dict(run_warm(storage, "r", 0, 2))
    later = dict(run_warm(storage, "r", 2, 1))  # another process's iterations count the same
    WARM.take(None)
    rows = iteration_rows(storage, "r")
    assert [r["iteration"] for r in rows] == [0, 1, 2]
    assert list(rows[0])[:3] == ["iteration", "reward_mean", "eval_exact_match"]  # reward and eval first
    for k, out in {**first, **later}.items():
        assert rows[k]["reward_mean"] == out["advantages"].manifest.summary["reward_mean"]
        assert rows[k]["eval_exact_match"] == out["eval"].manifest.summary["exact_match"]
        assert rows[k]["kl"] is None and rows[k]["entropy"] > 0  # kl_coef 0: no reference scored
    png, md = write_report(storage, "r")
    assert Path(png.removeprefix("file://")).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = Path(md.removeprefix("file://")).read_text()
    assert "![progress](report.png)" in text and len(re.findall(r"^\| [012] \|", text, re.M)) == 3


def tensorboard_scalars(folder: str, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(folder)
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


@pytest.mark.parametrize("backend", ["tensorboard", "mlflow"])
def test_tracking_sends_each_committed_iteration_once_and_a_resume_continues_the_same_tracker_run(
    storage, tmp_path, backend
):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    init_run(storage, "t", load_config(None, TINY + [f"tracking.backend={backend}", f"tracking.uri={uri}"]))
    outs = dict(run_warm(storage, "t", 0, 2))
    state = json.loads(storage.read_bytes(storage.path("runs", "t", "tracking.json")))
    outs.update(run_warm(storage, "t", 2, 1))  # a resume, as a new `grpo run` would
    list(run_warm(storage, "t", 2, 1))  # iteration 2 again, all reused: nothing sent twice
    WARM.take(None)
    resumed = json.loads(storage.read_bytes(storage.path("runs", "t", "tracking.json")))
    assert resumed["iterations"] == [0, 1, 2] and resumed["tracker_run_id"] == state["tracker_run_id"]
    want = [(k, outs[k]["advantages"].manifest.summary["reward_mean"]) for k in range(3)]
    if backend == "tensorboard":
        cfg = load_config(None, TINY)
        got = tensorboard_scalars(event_dir(storage, "t", cfg.tracking), "reward_mean")
    else:
        import mlflow

        client = mlflow.tracking.MlflowClient(uri)
        runs = client.search_runs([client.get_experiment_by_name("grpo-flow").experiment_id])
        assert [r.info.run_id for r in runs] == [state["tracker_run_id"]]  # one MLflow run for the whole run
        got = [(m.step, m.value) for m in client.get_metric_history(state["tracker_run_id"], "reward_mean")]
    assert [k for k, _ in sorted(got)] == [0, 1, 2]  # each iteration once
    assert [v for _, v in sorted(got)] == pytest.approx([v for _, v in want], rel=1e-6)


def test_turning_tracking_on_for_an_existing_run_is_allowed_other_changes_are_not(storage):
    from grpo.errors import StageError

    init_run(storage, "x", load_config(None, TINY))
    init_run(storage, "x", load_config(None, TINY + ["tracking.backend=tensorboard"]))
    assert json.loads(storage.read_bytes(storage.path("runs", "x", "run.json")))["config"]["tracking"]["backend"] == (
        "tensorboard"
    )
    with pytest.raises(StageError, match="exists with a different config"):
        init_run(storage, "x", load_config(None, TINY + ["tracking.backend=tensorboard", "learn.lr=0.01"]))


def md_table(text: str) -> list[dict]:
    """The rows of the first markdown table in `text`, {header: cell}."""
    lines = [line for line in text.splitlines() if line.startswith("|")]
    keys = [c.strip() for c in lines[0].strip("|").split("|")]
    return [dict(zip(keys, (c.strip() for c in line.strip("|").split("|")))) for line in lines[2:]]


def plots(fig) -> dict:
    """{title: Axes} of a figure's visible plots."""
    return {ax.get_title(): ax for ax in fig.axes if ax.get_visible()}


def test_report_plots_loss_grad_norm_lr_and_time_marks_reference_refreshes_and_aligns_the_eval_axis(storage):
    """What a TRL user looks for: loss, grad norm, learning rate and wall time; KL with the reference refreshes
    (learn.ref_update_every) marked where it drops; the held-out plot on the same iterations as the others under
    eval.every; KL a number in report.md, `-` where an eval was skipped."""
    from matplotlib import pyplot as plt

    from grpo.query import query

    extra = ["learn.kl_coef=0.05", "learn.ref_update_every=2", "eval.every=2"]
    init_run(storage, "k", load_config(None, TINY + extra))
    list(run_warm(storage, "k", 0, 3))
    WARM.take(None)
    rows = iteration_rows(storage, "k")
    assert [r["reference_iteration"] for r in rows] == [None, None, 2]  # the base, then iteration 2's snapshot
    assert reference_refreshes(rows) == [2]
    lrs = query(storage, "k", "SELECT iteration, arg_max(lr, step) AS lr FROM learn_metrics GROUP BY 1 ORDER BY 1")
    assert [r["lr"] for r in rows] == list(lrs.lr)  # the last step's
    for r in rows:
        assert isinstance(r["kl"], float) and isinstance(r["loss"], float) and r["grad_norm"] > 0
        assert r["iteration_s"] > r["rollouts_s"] + r["learn_s"] > 0  # six stages, of which these two

    fig = figure(rows, "k", best_iteration(storage, "k"))
    try:
        shown = plots(fig)
        for title in ["loss", "grad norm (before clipping)", "learning rate", "KL to the reference"]:
            assert shown[title].lines, title
        assert {line.get_label() for line in shown["wall time per iteration (s)"].lines} == {
            "iteration_s",
            "rollouts_s",
            "learn_s",
        }
        assert {ax.get_xlim() for ax in shown.values()} == {(-0.5, 2.5)}  # every plot spans iterations 0..2
        evals = {line.get_label(): list(line.get_xdata()) for line in shown["held-out eval"].lines}
        assert evals["eval_exact_match"] == [1, 2]  # eval.every=2: iteration 1 and the last
        refresh = [line for line in shown["KL to the reference"].lines if line.get_label() == "reference refresh"]
        assert [list(line.get_xdata()) for line in refresh] == [[2, 2]]
    finally:
        plt.close(fig)

    _, md = write_report(storage, "k")
    table = md_table(Path(md.removeprefix("file://")).read_text())
    assert [t["iteration"] for t in table] == ["0", "1", "2"]
    assert [float(t["kl"]) for t in table] == pytest.approx([r["kl"] for r in rows], rel=1e-3)
    assert [t["eval_exact_match"] for t in table][0] == "-"  # skipped, not "None"
    assert "None" not in Path(md.removeprefix("file://")).read_text()


def test_kl_off_leaves_its_plot_out_and_no_best_is_claimed_while_every_eval_is_0():
    from matplotlib import pyplot as plt

    rows = [
        {
            "iteration": k,
            "reward_mean": 0.1 * k,
            "eval_exact_match": 0.0,
            "eval_reward": 0.2,
            "kl": None,
            "loss": 0.01,
            "grad_norm": 1.0,
            "lr": 1e-3,
            "entropy": 1.0,
            "clip_frac": 0.0,
            "response_length": 5.0,
            "iteration_s": 1.0,
            "rollouts_s": 0.4,
            "learn_s": 0.3,
        }
        for k in range(3)
    ]
    zero = Best(2, "exact_match", 0.0, all_zero=True)
    fig = figure(rows, "z", zero)
    try:
        shown = plots(fig)
        assert "KL to the reference" not in shown and len(shown) == 9  # no empty box
        assert not [line for line in shown["held-out eval"].lines if line.get_label().startswith("best")]
    finally:
        plt.close(fig)
    assert "none is best yet" in headline(rows, zero) and "Best so far" not in headline(rows, zero)
    assert headline(rows, Best(1, "exact_match", 0.5)).endswith("Best so far: iteration 1 (exact_match 0.5).")
    assert "| kl |" not in markdown_table(rows)  # a figure no iteration has: no column of dashes


def test_best_iteration_says_when_every_eval_scored_0_and_export_best_refuses_then(tmp_path, capsys):
    from test_eval_cadence import commit_eval

    from grpo.record.layout import run_json

    storage = open_storage((tmp_path / "store").as_uri())
    storage.fs.makedirs(str(tmp_path / "store" / "runs" / "m"), exist_ok=True)
    cfg = load_config(None, [])
    storage.write_bytes_atomic(run_json(storage, "m"), json.dumps({"run_id": "m", "config": cfg.to_dict()}).encode())
    commit_eval(storage, "m", 0, {"exact_match": 0.0, "reward_mean": 0.1})
    commit_eval(storage, "m", 1, {"skipped": True})
    commit_eval(storage, "m", 2, {"exact_match": 0.0, "reward_mean": 0.3})
    best = best_iteration(storage, "m")
    assert best.all_zero and best.iteration == 2
    assert main(["--storage", storage.url, "export", "--run", "m", "--best", str(tmp_path / "x")]) == 2
    assert "every eval so far scored exact_match 0, so none is best" in capsys.readouterr().err
    commit_eval(storage, "m", 3, {"exact_match": 0.125, "reward_mean": 0.2})
    assert best_iteration(storage, "m") == Best(3, "exact_match", 0.125)


def test_a_finished_demo_run_again_says_where_it_reached_the_target_and_trains_nothing(tmp_path, capsys):
    """`grpo demo` again after it reached its target: where (the first iteration that did), no more iterations."""
    args = ["--storage", str(tmp_path / "storage"), "demo", "--target", "0.0"]
    for kv in TINY:
        args += ["--set", kv]
    assert main(args + ["--iterations", "2"]) == 0
    assert "held-out exact match reached 0.0 at iteration 0" in capsys.readouterr().out
    assert main(args) == 0  # again
    WARM.take(None)
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("run demo reached held-out exact match 0.0 already, at iteration 0 (")
    assert "nothing to train" in out[0] and out[1].startswith("run demo: ") and out[2].startswith("next: ")
    assert not (tmp_path / "storage" / "runs" / "demo" / "iter-0001").exists()  # trained nothing


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_mlflow_ui_serves_a_tracked_runs_metrics(storage, tmp_path):
    """The README's `mlflow ui --backend-store-uri ...` on what a tracked run wrote: its web page, and the run's
    metrics through MLflow's REST API, over HTTP on loopback."""
    pytest.importorskip("mlflow")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    init_run(storage, "m", load_config(None, TINY + ["tracking.backend=mlflow", f"tracking.uri={uri}"]))
    outs = dict(run_warm(storage, "m", 0, 2))
    WARM.take(None)
    tracker = json.loads(storage.read_bytes(storage.path("runs", "m", "tracking.json")))["tracker_run_id"]
    port, log = free_port(), tmp_path / "mlflow-ui.log"
    command = [str(Path(sys.executable).with_name("mlflow")), "ui", "--backend-store-uri", uri]
    with open(log, "wb") as out:
        server = subprocess.Popen(
            command + ["--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=tmp_path,
            start_new_session=True,  # its workers in its process group, stopped with it
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert server.poll() is None, log.read_text()[-3000:]  # flask missing: it exits at once
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(1)
        query = f"run_id={tracker}&metric_key=reward_mean"
        with urllib.request.urlopen(f"{url}/api/2.0/mlflow/metrics/get-history?{query}", timeout=30) as r:
            history = json.loads(r.read())["metrics"]
        want = [outs[k]["advantages"].manifest.summary["reward_mean"] for k in (0, 1)]
        assert sorted(m["step"] for m in history) == [0, 1]
        assert [m["value"] for m in sorted(history, key=lambda m: m["step"])] == pytest.approx(want, rel=1e-6)
        with urllib.request.urlopen(f"{url}/", timeout=30) as r:
            page = r.read().decode()
        assert "<html" in page.lower() and "Unable to display MLflow UI" not in page  # the UI's pages are there
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def test_doctests():
    import doctest

    import grpo.report

    result = doctest.testmod(grpo.report)
    assert result.attempted >= 2 and result.failed == 0
