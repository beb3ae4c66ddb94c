"""Rewards and side files that must not be trusted: reward workers that die, hang, hog memory or print
without end; finite rewards whose sums overflow; half-written side files; two processes racing to commit
one stage; run ids that hide what they say."""

import logging
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import pandas as pd
import pytest
from load import scaled
from test_stages import TINY

from grpo.config import ConfigError, RewardConfig, load_config
from grpo.errors import LayoutError, StageError
from grpo.record.commit import StageWriter
from grpo.record.layout import run_dir, stage_dir
from grpo.record.storage import committed_attempts, latest_committed, open_storage
from grpo.runtime.pool import RewardPool
from grpo.scoring.score import allowed_errors, score_batch
from grpo.tasks import functions
from stages import stage_function
from stages.common import run_stage
from stages.init import init_run

ROOT = Path(__file__).resolve().parents[1]

FUNCTIONS = """
import os, signal, time

def die(response, ground_truth, prompt):
    os._exit(3)

def die_on_marker(response, ground_truth, prompt):
    if response == "die":
        os._exit(3)
    return 1.0

def killed(response, ground_truth, prompt):  # what the OOM killer does
    os.kill(os.getpid(), signal.SIGKILL)

def hang_ignoring_alarm(response, ground_truth, prompt):
    signal.signal(signal.SIGALRM, signal.SIG_IGN)
    time.sleep(60)

def hang_swallowing_alarm(response, ground_truth, prompt):
    while True:
        try:
            time.sleep(60)
        except BaseException:
            pass

def hang_catching_exception(response, ground_truth, prompt):
    try:
        time.sleep(60)
    except Exception:  # the alarm is no Exception: still a timeout
        return 1.0

def hog(response, ground_truth, prompt):
    if response == "big":
        return float(len(bytearray(2 * 2**30)))
    return 1.0

def chatty(response, ground_truth, prompt):
    print("x" * 200_000)
    return 1.0
"""


@pytest.fixture(scope="module")
def funcs(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("rewards") / "funcs.py"
    path.write_text(FUNCTIONS)
    return str(path)


def key(path: str, name: str) -> tuple:
    """grpo.scoring.score.scorer_key of one function of the file `path`."""
    return "sort", (), (f"{path}:{name}",), None, (path,)


def items(n: int, markers: dict[int, str] = {}) -> list[tuple]:
    return [(markers.get(i, "1 2"), "1 2", "sort: 2 1", {}) for i in range(n)]


# ---------------------------------------------------------------- workers that die, hang, hog or print


def test_a_worker_that_exits_is_noticed_at_once_named_and_the_scoring_stops_over_the_bound(funcs):
    t0, bound_s = time.monotonic(), scaled(10)
    with RewardPool(2) as pool:
        with pytest.raises(StageError, match=r"more than the 3 .* the first: reward worker died in die: exit code 3$"):
            score_batch(pool, key(funcs, "die"), RewardConfig(workers=2, timeout_s=5), items(64), max_errors=3)
    assert time.monotonic() - t0 < bound_s  # the old pool waited 5 s x 64 samples + 30 s, then said "hung"


def test_a_dead_worker_costs_its_sample_only_and_is_replaced(funcs):
    with RewardPool(2) as pool:
        pids = {w.process.pid for w in pool.workers}
        scored = score_batch(
            pool, key(funcs, "die_on_marker"), RewardConfig(workers=2, timeout_s=5), items(300, {7: "die", 200: "die"})
        )
        assert {w.process.pid for w in pool.workers} != pids and all(w.process.is_alive() for w in pool.workers)
    assert [i for i, (_, _, e) in enumerate(scored) if e] == [7, 200]
    assert scored[7] == (0.0, {}, "reward worker died in die_on_marker: exit code 3")
    assert all(r == 1.0 and e is None for i, (r, _, e) in enumerate(scored) if i not in (7, 200))


def test_a_worker_killed_by_sigkill_says_out_of_memory(funcs):
    with RewardPool(1) as pool:
        [(_, _, error)] = score_batch(pool, key(funcs, "killed"), RewardConfig(workers=1, timeout_s=5), items(1))
    assert error == "reward worker died in killed: killed by SIGKILL (out of memory?)"


@pytest.mark.parametrize(
    "name, error, bound_s",
    [  # 4 samples of 1.2 s (the alarm, then the watchdog) or 0.2 s (the alarm) at most, where all 64 would
        # take 77 s or 13 s; the old pool waited 2 x 43 s, then said "hung", or 13 s (errors came with the job)
        ("hang_ignoring_alarm", r"hang_ignoring_alarm ran past its 0.2s alarm \(it ignored or blocked SIGALRM", 12),
        ("hang_swallowing_alarm", r"hang_swallowing_alarm ran past its 0.2s alarm", 12),
        ("hang_catching_exception", r"timeout after 0.2s", 4),
    ],
)
def test_a_function_that_always_hangs_stops_the_scoring_after_a_few_samples(funcs, name, error, bound_s):
    t0, bound_s = time.monotonic(), scaled(bound_s)
    cfg = RewardConfig(workers=2, timeout_s=0.2, max_error_fraction=0.05)
    with RewardPool(2) as pool:
        with pytest.raises(StageError, match=f"reward.max_error_fraction=0.05 allows; .* the first: {error}"):
            score_batch(pool, key(funcs, name), cfg, items(64), max_errors=allowed_errors(0.05, 64))
    assert time.monotonic() - t0 < bound_s


def test_max_memory_mb_makes_a_2gb_allocation_an_error_of_that_sample(funcs):
    cfg = RewardConfig(workers=1, timeout_s=20, max_memory_mb=256)
    with RewardPool(1) as pool:
        scored = score_batch(pool, key(funcs, "hog"), cfg, items(6, {1: "big", 4: "big"}))
    said = "MemoryError under reward.max_memory_mb=256"  # the cap the function ran into, not a bare MemoryError
    assert [e for _, _, e in scored] == [None, said, None, None, said, None]
    assert [r for r, _, _ in scored] == [1.0, 0.0, 1.0, 1.0, 0.0, 1.0]


def test_what_reward_functions_print_is_captured_and_logged_once_cut_short(funcs, caplog, capfd):
    caplog.set_level(logging.WARNING, logger="grpo.stages")
    with RewardPool(2) as pool:
        scored = score_batch(pool, key(funcs, "chatty"), RewardConfig(workers=2, timeout_s=5), items(64))
    assert all(e is None for _, _, e in scored)
    out, err = capfd.readouterr()
    assert len(out) + len(err) < 1000  # 200 KB a sample reached the terminal: 12.8 MB here
    [record] = [r for r in caplog.records if "printed" in r.getMessage()]
    message = record.getMessage()
    assert message.startswith(f"reward functions printed {64 * 200_001} bytes:")
    assert message.endswith(f"[... {64 * 200_001 - 4096} more bytes not shown]") and len(message) < 5000


# ---------------------------------------------------------------- rewards that overflow


def test_finite_rewards_whose_weighted_sum_overflows_fail_that_sample_naming_both_functions():
    scorer = functions.Scorer([("a", lambda r, g, p: 1e308), ("b", lambda r, g, p: 1e308)], [1.0, 1.0])
    with pytest.raises(ValueError, match=r"non-finite reward inf: 1 \* a \(1e\+308\) \+ 1 \* b \(1e\+308\) overflows"):
        scorer("1 2", "1 2", "sort: 2 1", {})


STAGE_REWARD = """
import itertools, os

_n = itertools.count()

def score(response, ground_truth, prompt):
    mode = os.environ.get("TRUST_REWARD", "ok")
    if mode == "exit":
        os._exit(3)
    if mode == "big":
        return 1e308
    if mode == "alternate":  # one worker scores the samples in order: +, -, +, - in every group
        return 1e307 if next(_n) % 2 else -1e307
    return float(len(response) % 2)
"""


@pytest.fixture(scope="module")
def rolled(tmp_path_factory):
    """A run with iteration 0's rollouts committed, scored by a function TRUST_REWARD switches."""
    folder = tmp_path_factory.mktemp("rolled")
    (folder / "reward.py").write_text(STAGE_REWARD)
    storage = open_storage((folder / "store").as_uri())
    extra = [
        "rollout.prompts_per_iteration=4",
        "learn.minibatch_size=16",
        "learn.microbatch_size=16",
        f"reward.functions=[{folder / 'reward.py'}:score]",
        "reward.truncated_reward=null",
    ]
    init_run(storage, "t", load_config(None, TINY + extra))
    stage_function("snapshot")(storage, "t", 0)
    stage_function("rollouts")(storage, "t", 0)
    return storage


def committed(storage, name: str) -> list[str]:
    return committed_attempts(storage, stage_dir(storage, "t", 0, name))


def test_the_rewards_stage_fails_fast_on_a_dying_function_and_commits_nothing(rolled, monkeypatch):
    monkeypatch.setenv("TRUST_REWARD", "exit")
    before, t0 = committed(rolled, "rewards"), time.monotonic()
    with pytest.raises(StageError, match=r"the first: reward worker died in score: exit code 3"):
        stage_function("rewards")(rolled, "t", 0, force=True)
    assert time.monotonic() - t0 < 20 and committed(rolled, "rewards") == before


def test_rewards_whose_sum_overflows_are_refused_naming_the_function(rolled, monkeypatch):
    monkeypatch.setenv("TRUST_REWARD", "big")
    before = committed(rolled, "rewards")
    with pytest.raises(StageError, match=r"rewards: the mean reward is inf .*reward function '.*reward.py:score' "):
        stage_function("rewards")(rolled, "t", 0, force=True)
    assert committed(rolled, "rewards") == before  # it committed reward_mean: inf


def test_advantages_refuse_group_statistics_that_overflow_naming_the_function(rolled, monkeypatch):
    monkeypatch.setenv("TRUST_REWARD", "alternate")
    stage_function("rewards")(rolled, "t", 0, force=True)  # each reward and their sum are finite
    before = committed(rolled, "advantages")
    with pytest.raises(StageError) as e:
        stage_function("advantages")(rolled, "t", 0, force=True)
    line = str(e.value)
    assert "\n" not in line and "reward function '" in line and "reward.py:score' returned " in line, line
    assert line.startswith("advantages: rewards of prompt_id ") and "overflow float64" in line, line
    assert committed(rolled, "advantages") == before  # it committed reward_std: nan


# ---------------------------------------------------------------- two processes, one run


def test_the_loser_of_a_race_to_commit_hears_another_process_committed(tmp_path):
    storage = open_storage((tmp_path / "store").as_uri())
    sdir = stage_dir(storage, "r", 0, "rewards")
    args = dict(run_id="r", iteration=0, stage="rewards", config={}, inputs={})

    def body(writer):  # meanwhile another process commits the same stage
        other = StageWriter(storage, sdir, **args)
        with storage.fs.open(other.path("rewards.parquet"), "wb") as f:
            f.write(b"theirs")
        won.append(other.commit().attempt_dir.rsplit("/", 1)[-1])
        return {}

    won: list[str] = []
    with pytest.raises(
        StageError, match=r"^another process committed rewards 0 \((attempt-\S+)\) while this one ran; "
    ):
        run_stage(storage, "r", 0, "rewards", config={}, inputs={}, body=body)
    assert [a.rsplit("/", 1)[-1] for a in committed_attempts(storage, sdir)] == won  # ours was not committed


def test_a_stale_chain_made_by_another_process_says_so(rolled, monkeypatch):
    monkeypatch.setenv("TRUST_REWARD", "ok")
    stage_function("rewards")(rolled, "t", 0, force=True)
    rollouts = latest_committed(rolled, stage_dir(rolled, "t", 0, "rollouts"))
    other = StageWriter(  # another process's rollouts, committed after this one's rewards read the first
        rolled,
        stage_dir(rolled, "t", 0, "rollouts"),
        run_id="t",
        iteration=0,
        stage="rollouts",
        config={**rollouts.manifest.config, "other": 1},
        inputs=rollouts.manifest.inputs,
    )
    rolled.fs.pipe_file(other.path("rollouts.parquet"), rolled.read_bytes(rollouts.path("rollouts.parquet")))
    attempt = other.commit().attempt_dir
    try:
        with pytest.raises(StageError) as e:
            stage_function("advantages")(rolled, "t", 0)
        name = attempt.rsplit("/", 1)[-1]
        assert str(e.value) == f"another process committed rollouts 0 ({name}) while this one ran; nothing to do"
    finally:
        rolled.fs.rm(attempt, recursive=True)


# ---------------------------------------------------------------- side files


def test_a_damaged_tracking_json_is_named_in_one_line(tmp_path):
    from grpo.tracking import state_path, track

    storage = open_storage((tmp_path / "store").as_uri())
    path = state_path(storage, "t")
    storage.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    storage.fs.pipe_file(path, b'{"iterations": [0, 1], "tracker_run_id": "ab')  # cut short
    with pytest.raises(StageError) as e:
        track(storage, "t", load_config(None, ["tracking.backend=tensorboard"]))
    assert str(e.value) == (
        f"{storage.uri(path)}: damaged (not valid JSON); delete it and rerun: tracking restarts a new tracker run"
    )


def half_writes(storage, monkeypatch):
    """Make every write of the storage stop half-way, as a process killed while writing."""

    def pipe_file(path, data, **kwargs):
        with open(path, "wb") as f:
            f.write(data[: len(data) // 2])
        raise OSError("killed while writing")

    monkeypatch.setattr(storage.fs, "pipe_file", pipe_file)


def test_tracking_json_is_replaced_whole_never_half_written(tmp_path, monkeypatch):
    import grpo.tracking as tracking

    storage = open_storage((tmp_path / "store").as_uri())
    path = tracking.state_path(storage, "t")
    storage.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    storage.fs.pipe_file(path, b'{"iterations": [0], "tracker_run_id": "run-1", "backend": "tensorboard"}')
    monkeypatch.setattr(tracking, "iteration_rows", lambda storage, run_id, skip: [{"iteration": 1, "kl": 0.5}])
    monkeypatch.setattr(tracking.figures, "reward_stats", lambda *args: {})  # no rewards table here
    monkeypatch.setattr(tracking.figures, "completions", lambda *args: [])
    monkeypatch.setitem(tracking.SENDERS, "tensorboard", types.SimpleNamespace(send=lambda *args: "run-1"))
    half_writes(storage, monkeypatch)
    with pytest.raises(OSError, match="killed while writing"):
        tracking.track(storage, "t", load_config(None, ["tracking.backend=tensorboard"]))
    assert tracking._load_state(storage, "t")["iterations"] == [0]  # the old state, whole


def test_report_files_are_replaced_whole_never_half_written(tmp_path, monkeypatch):
    import grpo.report as report

    storage = open_storage((tmp_path / "store").as_uri())
    md = f"{run_dir(storage, 't')}/report.md"
    storage.fs.makedirs(run_dir(storage, "t"), exist_ok=True)
    storage.fs.pipe_file(md, b"# Run t\n\nthe old report\n")
    monkeypatch.setattr(report, "figure_png", lambda rows, title, best=None, behavior=True: b"\x89PNG...")
    monkeypatch.setattr(report, "best_iteration", lambda *a: None)  # no run.json here
    monkeypatch.setattr(report, "behavior_drawn", lambda *a: True)
    half_writes(storage, monkeypatch)
    rows = [{"iteration": 0, "reward_mean": 0.5, "eval_exact_match": 0.25}]
    with pytest.raises(OSError, match="killed while writing"):
        report.write_report(storage, "t", rows)
    assert storage.read_bytes(md) == b"# Run t\n\nthe old report\n"
    assert not storage.exists(f"{run_dir(storage, 't')}/report.png")


# ---------------------------------------------------------------- run ids


@pytest.mark.parametrize("run_id", ["demo\u202egnp.exe", "a\u2066b\u2069", "zero\u200bwidth", "bell\x07", "two\nlines"])
def test_run_ids_with_control_or_bidi_characters_are_refused_in_one_line(tmp_path, run_id):
    storage = open_storage((tmp_path / "store").as_uri())
    with pytest.raises(LayoutError) as e:
        run_dir(storage, run_id)
    line = str(e.value)
    assert "\n" not in line and line.isprintable() and "must be a name without control or format characters" in line
    bad = next(c for c in run_id if not c.isprintable() or c == "\u200b")
    assert f"U+{ord(bad):04X}" in line


def test_a_plain_run_id_is_accepted(tmp_path):
    storage = open_storage((tmp_path / "store").as_uri())
    assert run_dir(storage, "exp-1_été").endswith("/runs/exp-1_été")


# ---------------------------------------------------------------- the flow's failure message


def test_the_flow_names_a_failed_stage_once(tmp_path, monkeypatch):
    import flows.tasks

    def fails(storage, run_id, iteration, force=False):
        raise StageError(f"rewards iteration {iteration}: input rollouts is stale: ...;\n rebuild the chain")

    monkeypatch.setattr(flows.tasks, "stage_function", lambda name: fails)
    state = flows.tasks.run_stage("rewards", (tmp_path / "store").as_uri(), "t", 3, None, False)
    assert state.message == "rewards iteration 3: input rollouts is stale: ...; rebuild the chain"


# ---------------------------------------------------------------- secrets kept from reward code

SECRET = "swordfish-0123456789abcdef"  # what AWS_SECRET_ACCESS_KEY holds in these tests

LEAK = """
import itertools, os

_n = itertools.count()

def leak(response, ground_truth, prompt):
    seen = os.environ.get("AWS_SECRET_ACCESS_KEY", "absent")
    copied = open(os.environ["TRUST_LEAK_FILE"]).read()  # a copy the fork inherited (memory, /proc/PPID/environ)
    judge = os.environ.get("JUDGE_API_KEY", "absent")
    print(f"printed env={seen} copy={copied}")
    if next(_n) == 0:
        raise KeyError(f"env={seen} copy={copied}")
    return {"total": 1.0, f"env={seen}": 0.0, f"copy={copied}": 0.0, f"judge={judge}": 0.0}
"""


def test_reward_code_never_sees_credentials_and_what_it_leaks_is_redacted(tmp_path, monkeypatch, caplog):
    """A reward function that reads the stage's credentials: os.environ has none of them (reward.pass_env
    passes one through); neither the secret it got anyway nor the one passed reaches the committed table (error,
    component names) or the log (printed output)."""
    (tmp_path / "leak.py").write_text(LEAK)
    (tmp_path / "secret").write_text(SECRET)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("JUDGE_API_KEY", "judge-key-passed-on")
    monkeypatch.setenv("TRUST_LEAK_FILE", str(tmp_path / "secret"))
    storage = open_storage((tmp_path / "store").as_uri())
    extra = [
        "rollout.prompts_per_iteration=4",
        "learn.minibatch_size=16",
        "learn.microbatch_size=16",
        f"reward.functions=[{tmp_path / 'leak.py'}:leak]",
        "reward.max_error_fraction=0.5",
        "reward.pass_env=[JUDGE_API_KEY]",
    ]
    init_run(storage, "s", load_config(None, TINY + extra))
    stage_function("snapshot")(storage, "s", 0)
    stage_function("rollouts")(storage, "s", 0)
    caplog.set_level(logging.INFO)
    out = stage_function("rewards")(storage, "s", 0)
    assert out.manifest.summary["errors"] == 1
    table = pd.read_parquet(storage.uri(out.path("rewards.parquet")))
    errors = [e for e in table.error if isinstance(e, str)]
    names = {k for comps in table.components for k, _ in comps}
    redacted = "<AWS_SECRET_ACCESS_KEY redacted>"
    assert errors == [f"KeyError: 'env=absent copy={redacted}'"], errors
    assert {"env=absent", f"copy={redacted}", "judge=<JUDGE_API_KEY redacted>"} <= names, names  # read, not kept
    for secret in (SECRET, "judge-key-passed-on"):
        assert secret not in repr(table.to_dict()) and secret not in caplog.text
    assert f"printed env=absent copy={redacted}" in caplog.text


def test_a_worker_holds_no_credential_in_its_environment_block(tmp_path):
    """/proc/self/environ shows the environment a process was started with: a worker blanks its credentials
    there too (the stage's were in it, as a real stage's are)."""
    script = tmp_path / "look.py"
    script.write_text(
        "import os\n"
        "from grpo.runtime.pool import RewardPool\n"
        "def look():\n"
        "    block = open('/proc/self/environ', 'rb').read()\n"
        f"    return os.environ.get('AWS_SECRET_ACCESS_KEY'), {SECRET!r}.encode() in block, b'PATH=' in block\n"
        "if __name__ == '__main__':\n"
        "    with RewardPool(1) as pool:\n"
        "        print(pool.apply(look))\n"
    )
    env = {**os.environ, "AWS_SECRET_ACCESS_KEY": SECRET, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "(None, False, True)", done.stdout + done.stderr[-2000:]


def test_pass_env_takes_variable_names():
    with pytest.raises(ConfigError, match=r"^reward.pass_env lists environment variable names .* got \['AWS_\*'\]"):
        load_config(None, ["reward.pass_env=[AWS_*]"])


AT_IMPORT = {  # module-level code of a reward file, run when `grpo init` checks it
    "reads": "import os\n"
    "open(os.environ['SEEN_FILE'], 'w').write(os.environ.get('AWS_SECRET_ACCESS_KEY', 'absent'))\n"
    "print('the module sees', open(os.environ['TRUST_LEAK_FILE']).read())\n",
    "exits": "import os\nos._exit(0)\n",
    "crashes": "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n",
}
SCORE = "\ndef score(response, ground_truth, prompt):\n    return 1.0\n"


def init_with(tmp_path, module: str) -> subprocess.CompletedProcess:
    """`grpo init` (a process of its own: an os._exit must not end the test) with reward file `module`."""
    (tmp_path / f"{module}.py").write_text(AT_IMPORT[module] + SCORE)
    (tmp_path / "secret").write_text(SECRET)
    env = {**os.environ, "AWS_SECRET_ACCESS_KEY": SECRET, "SEEN_FILE": str(tmp_path / "seen")}
    env |= {"TRUST_LEAK_FILE": str(tmp_path / "secret"), "PYTHONPATH": str(ROOT)}
    sets = [f"--set={s}" for s in TINY + [f"reward.functions=[{tmp_path / module}.py:score]"]]
    argv = [sys.executable, "-m", "flows.cli", "--storage", str(tmp_path / "store"), "init", "--run", "t", *sets]
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_init_imports_reward_files_in_a_worker_without_credentials(tmp_path):
    """grpo init imports a reward file where the rewards stage runs it: a reward worker, no credentials in its
    environment, what it prints logged with the secrets it found anyway redacted."""
    done = init_with(tmp_path, "reads")
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "seen").read_text() == "absent"
    assert SECRET not in done.stdout + done.stderr
    assert "the module sees <AWS_SECRET_ACCESS_KEY redacted>" in done.stderr


@pytest.mark.parametrize("module, how", [("exits", "exit code 0"), ("crashes", "killed by SIGSEGV")])
def test_a_reward_file_that_exits_or_crashes_as_it_imports_fails_init_in_one_line(tmp_path, module, how):
    done = init_with(tmp_path, module)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr[-2000:]
    assert f"reward.functions: '{tmp_path / module}.py:score': importing it in a reward worker failed" in done.stderr
    assert how in done.stderr and not (tmp_path / "store" / "runs" / "t").exists()
