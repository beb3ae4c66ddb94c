"""rollout.rollout_func (issue 54, item 7): TRL's rollout_func, `fn(prompts, sampler) -> {prompt_ids, completion_ids,
logprobs[, env_mask]}`, makes each chunk's samples; the rollouts table holds what it returned token for token and the
learner trains on it; what is wrong in it is one line naming the function, nothing committed."""

import math
import textwrap

import pytest
from test_stages import make_run

from grpo.config import ConfigError, load_config
from grpo.errors import StageError
from grpo.query import query
from grpo.record.layout import stage_dir
from grpo.record.storage import committed_attempts, open_storage
from grpo.sampling.base import SamplingSpec
from grpo.sampling.rollout_func import RolloutFunction
from stages.iteration import run_warm
from stages.rollouts import rollouts
from stages.snapshot import snapshot

FIXED = """
def rollout(prompts, sampler):
    # TRL's shape, forced: each prompt's num_generations completions are 3 fixed tokens, the middle one masked
    n = sampler.num_generations * len(prompts)
    return {
        "prompt_ids": [[1, 2, 3 + (i // sampler.num_generations) % 8] for i in range(n)],
        "completion_ids": [[5, 6, 7]] * n,
        "logprobs": [[-1.0, -2.0, -3.0]] * n,
        "env_mask": [[1, 0, 1]] * n,
    }
"""

SAMPLED = """
def rollout(prompts, sampler):
    # as TRL's examples do: tokenize the prompts, sample with the trainer's (here the stage's) sampler
    ids = [sampler.processing_class(p, add_special_tokens=False)["input_ids"] for p in prompts]
    out = sampler.generate(ids)
    out["env_mask"] = [[0] + [1] * (len(c) - 1) for c in out["completion_ids"]]  # the first token not learned
    return out
"""


@pytest.fixture
def storage(tmp_path):
    return open_storage((tmp_path / "store").as_uri())


def with_function(tmp_path, source: str) -> str:
    path = tmp_path / "my_rollout.py"
    path.write_text(textwrap.dedent(source))
    return f"rollout.rollout_func={path}:rollout"


def test_the_rollouts_table_holds_what_the_function_returned_and_learn_trains_on_it(storage, tmp_path):
    cfg = make_run(storage, "r", extra=[with_function(tmp_path, FIXED)])
    (tmp_path / "my_rollout.py").unlink()  # the run's copy is what runs
    for _ in run_warm(storage, "r", 0, 1):
        pass
    rows = query(storage, "r", "SELECT prompt_id, sample_index, prompt_ids, response_ids, sampler_logprobs, loss_mask "
                               "FROM rollouts ORDER BY prompt_id, sample_index")  # fmt: skip
    assert len(rows) == cfg.rollout.prompts_per_iteration * cfg.rollout.group_size
    for row in rows.itertuples():
        assert list(row.prompt_ids) == [1, 2, 3 + row.prompt_id % 8]  # one chunk: the prompt's place in it
        assert list(row.response_ids) == [5, 6, 7] and list(row.loss_mask) == [1, 0, 1]
        assert list(row.sampler_logprobs) == [-1.0, -2.0, -3.0]
    assert committed_attempts(storage, stage_dir(storage, "r", 0, "learn"))  # the learner took them


def test_a_function_sampling_with_the_stages_sampler(storage, tmp_path):
    cfg = make_run(storage, "r", extra=[with_function(tmp_path, SAMPLED)])
    snapshot(storage, "r", 0)
    rollouts(storage, "r", 0)
    rows = query(storage, "r", "SELECT prompt, prompt_ids, response_ids, sampler_logprobs, loss_mask FROM rollouts")
    assert len(rows) == cfg.rollout.prompts_per_iteration * cfg.rollout.group_size
    from transformers import AutoTokenizer

    from grpo.record.checkpoint import local_checkpoint
    from grpo.record.lineage import committed_input

    tok = AutoTokenizer.from_pretrained(local_checkpoint(committed_input(storage, "r", None, "base")))
    for row in rows.itertuples():
        assert list(row.prompt_ids) == tok(row.prompt, add_special_tokens=False)["input_ids"]
        n = len(row.response_ids)
        assert 1 <= n <= cfg.rollout.max_tokens and len(row.sampler_logprobs) == n
        assert all(math.isfinite(x) and x <= 0 for x in row.sampler_logprobs)
        assert list(row.loss_mask) == [0] + [1] * (n - 1)


def fn_returning(out):
    return RolloutFunction(lambda prompts, sampler: out, "my.py:rollout", vocab_size=10, eos_ids=(0,))


GOOD = {"prompt_ids": [[1, 2]] * 2, "completion_ids": [[3, 4]] * 2, "logprobs": [[-0.5, -0.1]] * 2}


@pytest.mark.parametrize(
    "change, said",
    [
        ({"logprobs": None}, r"returned \['completion_ids', 'prompt_ids'\], not a dict with TRL's keys"),
        ({"extra": [1, 1]}, r"returned keys \['extra'\] this stage does not take"),
        ({"completion_ids": [[3, 4]]}, r"completion_ids has 1 entries, not 2 \(1 prompts x num_generations 2"),
        ({"logprobs": [[-0.5, float("nan")]] * 2}, r"completion 0 \(prompt 0, sample 0\): logprobs must be 2 finite"),
        ({"logprobs": [[-0.5]] * 2}, r"completion 0 \(prompt 0, sample 0\): logprobs must be 2 finite"),
        ({"logprobs": [[-0.5, 0.7]] * 2}, r"a log-probability above 0"),
        ({"env_mask": [[1, 2]] * 2}, r"env_mask must be 2 values of 0 or 1"),
        ({"completion_ids": [[3, 40]] * 2}, r"completion_ids must be a non-empty list of token ids in \[0, 10\)"),
        ({"completion_ids": [[3, 4, 5, 6]] * 2, "logprobs": [[-1.0] * 4] * 2}, r"4 completion tokens, more than"),
        ({"prompt_ids": [[1, 2], [1, 3]]}, r"completion 1: prompt_ids differ from its group's first"),
    ],
)
def test_what_is_wrong_in_its_return_is_one_line_naming_the_function(change, said):
    out = {k: v for k, v in (GOOD | change).items() if v is not None}
    with pytest.raises(StageError, match=r"^rollout.rollout_func my.py:rollout: (completion .*: )?" + said) as e:
        fn_returning(out)(None, None, ["p"], SamplingSpec(n=2, max_tokens=3), context=64)
    assert "\n" not in str(e.value)
    groups = fn_returning(GOOD)(None, None, ["p"], SamplingSpec(n=2, max_tokens=3), context=64)
    assert [[s.response_ids for s in g] for g in groups] == [[[3, 4], [3, 4]]]


def test_a_bad_return_in_the_stage_commits_nothing(storage, tmp_path):
    make_run(storage, "r", extra=[with_function(tmp_path, FIXED.replace("-2.0", "float('inf')"))])
    snapshot(storage, "r", 0)
    with pytest.raises(StageError, match=r"rollout.rollout_func .*my_rollout.py:rollout: completion 0 .*finite"):
        rollouts(storage, "r", 0)
    assert not committed_attempts(storage, stage_dir(storage, "r", 0, "rollouts"))


def test_the_config_refuses_it_with_episodes_or_segments_and_init_a_missing_function(storage, tmp_path):
    for clash in ("rollout.tools=[m:f]", "rollout.segment_tokens=4"):
        with pytest.raises(ConfigError, match=r"rollout.rollout_func with rollout\.\w+: .* unset one of them"):
            load_config(None, ["rollout.rollout_func=m:f", clash])
    with pytest.raises(ConfigError, match=r"rollout.rollout_func: 'nofunction' is not of the form"):
        load_config(None, ["rollout.rollout_func=nofunction"])
    spec = with_function(tmp_path, FIXED).replace(":rollout", ":missing")
    with pytest.raises(ConfigError, match=r"rollout.rollout_func: .*my_rollout.py:missing.* has no function 'missing'"):
        make_run(storage, "r", extra=[spec])


def test_train_takes_trls_rollout_func_by_reference_and_the_cli_trains_on(tmp_path):
    import importlib.util
    import json
    import sys

    import yaml
    from test_stages import TINY

    from flows.cli import main
    from grpo import train
    from grpo.record.layout import run_json

    path = tmp_path / "my_rollout.py"
    path.write_text(textwrap.dedent(FIXED))
    spec = importlib.util.spec_from_file_location("user_rollout", path)  # the user's `from my_rollout import rollout`
    module = sys.modules["user_rollout"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    url = (tmp_path / "store").as_uri()
    config = {k: yaml.safe_load(v) for k, v in (s.split("=", 1) for s in TINY)}
    train(config=config, rollout_func=module.rollout, run="f", iterations=1, storage=url)
    storage = open_storage(url)
    assert (
        json.loads(storage.read_bytes(run_json(storage, "f")))["config"]["rollout"]["rollout_func"] == f"{path}:rollout"
    )
    path.unlink()  # the run holds its copy
    assert main(["--storage", url, "run", "--run", "f", "--iterations", "1"]) == 0
    assert set(query(storage, "f", "SELECT DISTINCT loss_mask FROM rollouts")["loss_mask"].map(tuple)) == {(1, 0, 1)}
