"""The Python API in TRL's shape for agents (issue 54, item 4): `train(..., tools=[fn], environment_factory=Cls,
reward_funcs=[...], train_dataset=datasets.Dataset)` makes the run the CLI makes, its functions and class recorded
by reference (a file of the user's copied into the run, an installed module by name), so a later process trains on;
a function or class written into a config is refused naming the string to write."""

import importlib.util
import json
import sys

import pandas as pd
import pytest
import yaml
from tool_world import config, world

from flows.api import code_spec
from flows.cli import main
from grpo import train
from grpo.config import ConfigError, load_config
from grpo.record.layout import run_json, stage_dir
from grpo.record.storage import committed_attempts, open_storage


def user_module(path, name: str):
    """`import name` of a user's file, as their script would."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return world(tmp_path_factory.mktemp("tools"))


def test_code_is_named_by_file_or_module_and_a_scripts_own_is_refused(root):
    env = user_module(root / "calculator_env.py", "user_calculator_env")
    assert code_spec(env.Calculator, "environment_factory") == f"{root / 'calculator_env.py'}:Calculator"
    assert code_spec(json.dumps, "tools") == "json:dumps"  # an installed (here: the standard) module's, by name
    assert code_spec("m.py:f", "tools") == "m.py:f"
    with pytest.raises(ConfigError, match=r"environment_factory: .* not a module-level function or class"):
        code_spec(lambda: env.Calculator(), "environment_factory")
    scripted = type("Game", (), {"__module__": "__main__"})
    with pytest.raises(ConfigError, match=r"Game is defined in the script or notebook being run \(__main__\)"):
        code_spec(scripted, "environment_factory")


def test_a_class_in_the_config_is_refused_naming_the_string_to_write(root):
    env = user_module(root / "calculator_env.py", "user_calculator_env")
    with pytest.raises(ConfigError) as refused:
        load_config({"rollout": {"environment": env.Calculator}})
    line = str(refused.value)
    assert line.startswith("rollout.environment: expected a string, got the class Calculator; write it as")
    assert f"'{root / 'calculator_env.py'}:Calculator' here" in line and "environment_factory=" in line, line
    with pytest.raises(ConfigError, match=r"rollout.tools: expected a list of strings, got the function dumps"):
        load_config({"rollout": {"tools": [json.dumps]}})


@pytest.mark.e2e
def test_train_takes_trls_agent_arguments_and_the_cli_trains_on(root, tmp_path):
    from datasets import Dataset

    env = user_module(root / "calculator_env.py", "user_calculator_env")
    tools = user_module(root / "tools.py", "user_tools")
    settings = [s for s in config(root) if not s.startswith(("model.", "task.dataset", "rollout.tools", "reward."))]
    settings += ["reward.workers=1"]
    sizes = {k: yaml.safe_load(v) for k, v in (s.split("=", 1) for s in settings)}
    url = (tmp_path / "store").as_uri()
    done = train(
        model=str(root / "model"),
        train_dataset=Dataset.from_pandas(pd.read_parquet(root / "questions.parquet")),
        tools=[tools.secret],
        environment_factory=env.Calculator,
        reward_funcs=[env.used_the_calculator],  # TRL's shape: (environments, **kwargs)
        config=sizes,
        run="agents",
        iterations=1,
        storage=url,
    )
    assert done.iteration == 0
    storage = open_storage(url)
    rollout = json.loads(storage.read_bytes(run_json(storage, "agents")))["config"]["rollout"]
    assert rollout["environment"] == f"{root / 'calculator_env.py'}:Calculator"
    assert rollout["tools"] == [f"{root / 'tools.py'}:secret"]
    (root / "calculator_env.py").rename(root / "moved.py")  # the run holds its own copy: it needs the file no more
    assert main(["--storage", url, "run", "--run", "agents", "--iterations", "1"]) == 0
    assert committed_attempts(storage, stage_dir(storage, "agents", 1, "rewards"))
