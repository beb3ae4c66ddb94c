"""Trackers as full as TRL's (grpo.tracking): an MLflow run of `grpo run` holds every setting as a parameter, each
reward function's mean and std, metrics grouped by prefix and a table of sample completions an iteration, and ends
FINISHED, or FAILED when the command fails (a later command reopens it); TensorBoard's run is named after the run
id and holds the same figures, the settings as hparams and text, the completions as text."""

import json

import pytest
from test_stages import TINY

import stages.iteration
from flows.cli import main
from grpo.config import load_config
from grpo.errors import StageError
from grpo.record.storage import open_storage
from grpo.tracking import event_dir, figures

REWARDS = (
    "def exact(response, ground_truth, prompt):\n    return float(response.split() == ground_truth.split())\n\n"
    "def share(response, ground_truth, prompt):\n"
    "    got, want = response.split(), ground_truth.split()\n"
    "    return {'total': sum(a == b for a, b in zip(got, want)) / len(want), 'length': float(len(got))}\n"
)
GROUPS = ("train/", "eval/", "actor/", "rewards/", "behavior/", "perf/")


@pytest.fixture
def tracked(tmp_path):
    """(storage, the --set args of a run scored by two reward functions, the MLflow store's URI)."""
    (tmp_path / "r.py").write_text(REWARDS)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    sets = TINY + [f"reward.functions=[{tmp_path / 'r.py'}:exact, {tmp_path / 'r.py'}:share]", f"tracking.uri={uri}"]
    return open_storage((tmp_path / "store").as_uri()), [a for kv in sets for a in ("--set", kv)], uri


def grpo(storage, *args) -> int:
    return main(["--storage", storage.url, *args])


def test_an_mlflow_run_ends_finished_with_every_setting_per_reward_metrics_and_completions(tracked, monkeypatch):
    import mlflow

    storage, sets, uri = tracked
    assert grpo(storage, "init", "--run", "m", *sets, "--set", "tracking.backend=mlflow") == 0
    assert grpo(storage, "run", "--run", "m", "--iterations", "2") == 0
    client = mlflow.tracking.MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("grpo-flow").experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == "m"
    cfg = load_config(None, [s for s in sets if s != "--set"] + ["tracking.backend=mlflow"])
    assert run.data.params == {k: str(v) for k, v in figures.settings(cfg).items()}  # every setting
    assert run.data.params["learn.lr"] == str(cfg.learn.lr) and "reward.functions" in run.data.params
    metrics = run.data.metrics
    for name in ("exact", "share", "share/length", "total"):
        assert {f"rewards/{name}/mean", f"rewards/{name}/std"} <= set(metrics), name
    assert metrics["rewards/share/mean"] > metrics["rewards/exact/mean"] >= 0  # partial credit scores more
    assert all(k.startswith(GROUPS) for k in metrics), sorted(metrics)
    assert {"train/reward_mean", "eval/exact_match", "actor/loss", "perf/iteration_s"} <= set(metrics)
    tables = [a.path for a in client.list_artifacts(run.info.run_id, "completions")]
    assert tables == ["completions/iter-0000.json", "completions/iter-0001.json"]
    table = json.loads(open(client.download_artifacts(run.info.run_id, tables[0])).read())
    assert table["columns"] == ["iteration", "prompt_id", "prompt", "response", "reward"]
    assert len(table["data"]) == figures.COMPLETIONS

    real = stages.iteration.run_iteration

    def failing(storage_, run_id, k, **kw):
        if k == 3:
            raise StageError("rewards 3: a verifier crashed")
        return real(storage_, run_id, k, **kw)

    monkeypatch.setattr(stages.iteration, "run_iteration", failing)
    assert grpo(storage, "run", "--run", "m", "--iterations", "2") == 2  # iteration 2 sent, then 3 fails
    assert client.get_run(run.info.run_id).info.status == "FAILED"
    monkeypatch.setattr(stages.iteration, "run_iteration", real)
    assert grpo(storage, "run", "--run", "m", "--iterations", "1") == 0  # the same tracker run, reopened
    again = client.get_run(run.info.run_id)
    assert again.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/reward_mean")] == [0, 1, 2, 3]


def test_tensorboard_names_the_run_and_holds_settings_rewards_and_completions(tracked):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    storage, sets, _ = tracked
    assert grpo(storage, "init", "--run", "tb", *sets, "--set", "tracking.backend=tensorboard") == 0
    assert grpo(storage, "run", "--run", "tb", "--iterations", "1") == 0
    cfg = load_config(None, [s for s in sets if s != "--set"])
    folder = event_dir(storage, "tb", cfg.tracking)
    assert folder.endswith("/tensorboard/tb")  # `tensorboard --logdir runs/tb/tensorboard` shows run "tb"
    acc = EventAccumulator(folder, size_guidance={"tensors": 0})
    acc.Reload()
    scalars = acc.Tags()["scalars"]
    assert {"train/reward_mean", "rewards/exact/mean", "rewards/share/std", "eval/exact_match"} <= set(scalars)
    assert all(k.startswith(GROUPS) for k in scalars), scalars
    texts = {t: acc.Tensors(t) for t in acc.Tags()["tensors"]}
    assert {"settings/text_summary", "completions/text_summary"} <= set(texts)
    settings = texts["settings/text_summary"][0].tensor_proto.string_val[0].decode()
    assert "| learn.lr | 0.0" in settings and settings.count("\n") == len(figures.settings(cfg)) + 1
    from tensorboard.plugins.hparams import plugin_data_pb2

    start = acc.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hparams = plugin_data_pb2.HParamsPluginData.FromString(start).session_start_info.hparams
    assert set(hparams) == set(figures.settings(cfg)) and hparams["learn.lr"].number_value == cfg.learn.lr
