"""The Python API in TRL's shape (`from grpo import train`, flows/api.py): a lambda reward trains the demo task, its
cloudpickled bytes recorded by hash in the run, and the run is the one the CLI makes (the CLI trains on with it); a
dataset object is stored once by its hash; TRL's GRPOConfig names are refused naming their settings, and README's
"Coming from TRL" table is grpo/trl_names.py's."""

import hashlib
import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_stages import TINY

from grpo import train
from grpo.config import ConfigError
from grpo.query import query
from grpo.record.layout import run_json, stage_dir
from grpo.record.storage import latest_committed, open_storage
from grpo.tasks import functions, get_task
from grpo.trl_names import GRPO_CONFIG, GRPO_TRAINER, NAMES
from tests.doc_pages import page

ROOT = Path(__file__).resolve().parents[1]
ENV = {k: v for k, v in os.environ.items() if not k.startswith(("GRPO_", "VLLM_"))}
CONFIG = {kv.split("=", 1)[0]: yaml.safe_load(kv.split("=", 1)[1]) for kv in TINY}  # {"learn.lr": ..., ...}


def positions(completions, ground_truth, **kwargs):
    """TRL's shape: a list of rewards for a list of completions."""
    return [
        sum(a == b for a, b in zip(c.split(), g.split())) / len(g.split()) for c, g in zip(completions, ground_truth)
    ]


def scored(storage, run_id: str, where: str = "TRUE") -> tuple[list[float], list[float]]:
    """(the committed rewards, what `positions` gives the committed responses: TINY scores a cut-off one 0)."""
    rows = query(storage, run_id, "SELECT r.reward, o.response, o.ground_truth, o.finish_reason FROM rewards r "
                 f"JOIN rollouts o USING (iteration, prompt_id, sample_index) WHERE {where}")  # fmt: skip
    want = positions(list(rows.response), list(rows.ground_truth))
    return list(rows.reward), [0.0 if f == "length" else w for w, f in zip(want, rows.finish_reason)]


def stored(url: str, run_id: str) -> dict:
    storage = open_storage(url)
    return json.loads(storage.read_bytes(run_json(storage, run_id)))["config"]


def test_a_lambda_reward_trains_the_demo_task_and_the_cli_trains_on(tmp_path):
    url = (tmp_path / "store").as_uri()
    reward = lambda completions, ground_truth, **kw: positions(completions, ground_truth)  # noqa: E731
    done = train(reward_funcs=[reward], config=CONFIG, run="api", iterations=2, storage=url)
    assert done.run == "api" and done.iteration == 1 and "/runs/api/iter-0001/learn/attempt-" in done.policy
    assert done.eval_exact_match is not None and done.reward_mean > 0

    (spec,) = stored(url, "api")["reward"]["functions"]
    assert re.fullmatch(r"pickled/reward_0-[0-9a-f]{16}\.pkl:reward_0", spec)
    storage = open_storage(url)
    base = latest_committed(storage, stage_dir(storage, "api", None, "base"))
    (copy,) = [f for f in base.manifest.files if f.path == functions.committed_name(0, spec)]
    data = open(base.path(copy.path), "rb").read()
    assert copy.sha256 == hashlib.sha256(data).hexdigest() and spec.split("-")[1].startswith(copy.sha256[:16])

    got, want = scored(storage, "api")
    assert got == pytest.approx(want) and len(set(want)) > 1  # the lambda scored every sample

    # the run is the CLI's: a new process trains on, its reward workers unpickling the run's copy
    cli = [sys.executable, "-m", "flows.cli", "--storage", url, "--threads", "1"]
    done = subprocess.run([*cli, "run", "--run", "api"], cwd=ROOT, env=ENV, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    got, want = scored(storage, "api", "iteration = 2")
    assert got and got == pytest.approx(want)


def test_the_api_makes_the_run_grpo_init_makes(tmp_path):
    url = (tmp_path / "store").as_uri()
    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump({"learn": {"lr": 0.002}, "rollout": {"group_size": 4}}))
    train(config=str(config), run="a", iterations=0, storage=url)
    train(config={"learn.lr": 0.002, "rollout": {"group_size": 4}}, run="b", iterations=0, storage=url)
    cli = [sys.executable, "-m", "flows.cli", "--storage", url, "init", "--run", "c", "--config", str(config)]
    assert subprocess.run(cli, cwd=ROOT, env=ENV, capture_output=True).returncode == 0
    assert stored(url, "a") == stored(url, "b") == stored(url, "c")


def test_a_dataset_object_is_stored_once_by_its_hash(tmp_path):
    import datasets

    url = (tmp_path / "store").as_uri()
    examples = get_task("sort").generate(48, seed=0)
    ds = datasets.Dataset.from_dict({"prompt": [e.prompt for e in examples], "ground_truth": [e.ground_truth for e in
                                                                                           examples]})  # fmt: skip
    train(dataset=ds, config=CONFIG, run="d", iterations=0, storage=url)
    where = stored(url, "d")["task"]["dataset"]
    assert re.fullmatch(r"file://.*/datasets/[0-9a-f]{32}\.parquet", where)
    train(dataset=ds.to_pandas(), config=CONFIG, run="d", iterations=0, storage=url)  # the same bytes: the same run
    assert stored(url, "d")["task"]["dataset"] == where


def test_trl_names_are_refused_naming_their_settings_and_readme_has_the_table(tmp_path):
    with pytest.raises(ConfigError, match=r"num_generations.*rollout\.group_size"):
        train(config={"num_generations": 4}, iterations=0, storage=str(tmp_path))
    with pytest.raises(ConfigError, match=r"learn\.beta.*learn\.kl_coef"):
        train(config={"learn.beta": 0.1}, iterations=0, storage=str(tmp_path))
    assert list(tmp_path.iterdir()) == []  # nothing written
    section = page("coming-from-trl.md").split("\n## ", 1)[0]
    table = {m[0]: m[1] for m in re.findall(r"^\| `(\w+)` \| (?:`([\w.]+)`)? *\|", section, re.M)}
    assert table == {name: setting for name, (setting, _) in NAMES.items()}


def test_every_trl_name_is_a_grpo_config_field_and_every_setting_exists():
    trl = pytest.importorskip("trl")
    import dataclasses

    from grpo.config import _settings

    fields = {f.name for f in dataclasses.fields(trl.GRPOConfig)}
    assert set(GRPO_CONFIG) <= fields, set(GRPO_CONFIG) - fields
    arguments = set(inspect.signature(trl.GRPOTrainer).parameters)
    assert set(GRPO_TRAINER) <= arguments, set(GRPO_TRAINER) - arguments
    settings = set(_settings())
    assert {s for s, _ in NAMES.values() if s} <= settings
