"""First run to insight: the demo that learns, quiet output, the backend `auto` picks, the report
and experiment tracking (TensorBoard event files, an MLflow store)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from grpo.config import load_config
from grpo.report import iteration_rows, write_report
from grpo.sampling import engines
from grpo.storage import open_storage
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
