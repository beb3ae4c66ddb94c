"""No dead ends, settings checked at `grpo init`, a status that tells the truth (issue 35, items 5-7).

Each test keeps the repro of a way a run used to go wrong: a forced stage after `grpo gc --retention` that no
command could rebuild, a same-size edit of a dataset on a web server, settings accepted at init that failed
an iteration later (or never), dynamic sampling drawing rounds from a constant reward, iterations after a
forced stage shown `ok`, shards that `grpo status` and `grpo gc` did not see.
"""

import functools
import hashlib
import http.server
import json
import logging
import os
import re
import threading

import pytest
from test_shards import CHUNKED, SHARDED
from test_stages import make_run
from test_trust_inputs import arithmetic, config, write_jsonl

import stages.init
import stages.rewards
from flows.cli import main
from grpo.config import ConfigError, load_config
from grpo.record import pins
from grpo.record.layout import run_dir, shard_stage, stage_dir
from grpo.record.lineage import next_iteration
from grpo.record.storage import committed_attempts, latest_committed, list_attempts, open_storage, read_collected
from stages import StageError, stage_function
from stages.common import check_datasets
from stages.init import init_run
from stages.iteration import run_iteration, run_warm


@pytest.fixture
def storage(tmp_path, monkeypatch):
    monkeypatch.setenv("GRPO_CACHE", str(tmp_path / "cache"))
    return open_storage((tmp_path / "store").as_uri())


def cli(storage, capsys, *args) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(["--storage", storage.url, *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


# ---------------------------------------------------------------- 5a. a force that nothing could rebuild after


def test_a_force_whose_rebuild_needs_collected_files_is_refused_naming_a_command_that_works(storage, capsys):
    make_run(storage, "r", extra=["retention.keep_last=1"])
    for _ in run_warm(storage, "r", 0, 2):
        pass
    assert cli(storage, capsys, "gc", "--run", "r", "--retention", "--delete")[0] == 0  # learn 0: policy and state go
    rewards_1 = list_attempts(storage, stage_dir(storage, "r", 1, "rewards"))
    rc, _, err = cli(storage, capsys, "stage", "rewards", "--run", "r", "--iteration", "1", "--force")
    assert rc == 2 and err.count("\n") == 1, err
    assert re.search(r"iteration 0's (policy and )?optimizer state, which was collected by `grpo gc --retention`", err)
    assert "iter-0000/learn/attempt-" in err  # where the collected files were
    assert "nothing written" in err and "`grpo run --run r --start 2`" in err
    assert list_attempts(storage, stage_dir(storage, "r", 1, "rewards")) == rewards_1  # the run as it was
    assert next_iteration(storage, "r") == 2
    rc, out, err = cli(storage, capsys, "run", "--run", "r", "--start", "2")  # the command it named works
    assert rc == 0 and "newest policy: iteration 2" in out, err
    assert stage_function("eval")(storage, "r", 2, force=True)  # eval needs no earlier learn: forcing it stays allowed


def test_a_run_left_stale_past_a_collected_learn_says_how_its_policy_goes_on(storage, capsys, tmp_path):
    make_run(storage, "r", extra=["retention.keep_last=1"])
    for _ in run_warm(storage, "r", 0, 2):
        pass
    assert cli(storage, capsys, "gc", "--run", "r", "--retention", "--delete")[0] == 0
    stages.rewards.rewards(storage, "r", 1, force=True)  # forced before dead_end was checked, or behind its back
    rc, _, err = cli(storage, capsys, "run", "--run", "r")
    assert rc == 2 and err.count("\n") == 1, err
    assert "iteration 1 is stale and rerunning its learn needs iteration 0's" in err and "nothing run" in err
    assert "`grpo export --run r --iteration 1 --out DIR`" in err, err  # asked by number: stale learn 1's policy
    assert "`grpo init --run NEW --set model.base_model=DIR`" in err
    assert not list_attempts(storage, stage_dir(storage, "r", 1, "advantages"))[1:]  # nothing rerun
    rc, _, err = cli(storage, capsys, "stage", "snapshot", "--run", "r", "--iteration", "2")  # reads stale learn 1
    assert rc == 2 and "rebuild the chain with `grpo run --run r --start 1`" in err, err  # which then says the above
    policy = tmp_path / "policy"  # the commands it named work
    assert cli(storage, capsys, "export", "--run", "r", "--iteration", "1", "--out", str(policy))[0] == 0
    assert cli(storage, capsys, "init", "--run", "new", "--set", f"model.base_model={policy}")[0] == 0


# ---------------------------------------------------------------- 5b. a web server's dataset is pinned by its bytes


ETAGS = {  # what web servers send as a file's ETag
    "nginx": lambda path, st: f'"{int(st.st_mtime):x}-{st.st_size:x}"',  # its mtime and size
    "apache": lambda path, st: f'"{st.st_size:x}-{int(st.st_mtime * 1e6):x}"',  # its size and mtime in microseconds
    "md5": lambda path, st: '"%s"' % hashlib.md5(open(path, "rb").read()).hexdigest(),  # its content (S3 behind a CDN)
}


class Server:
    """A static file server on loopback (python's http.server: Last-Modified and Content-Length, no ETag);
    `etag` adds an ETag of ETAGS' kind, `short` names files whose body stops short of their Content-Length."""

    def __init__(self, folder, etag: str | None = None, short: tuple[str, ...] = ()):
        class Handler(http.server.SimpleHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def end_headers(self):
                path = self.translate_path(self.path)
                if etag and os.path.isfile(path):
                    self.send_header("ETag", ETAGS[etag](path, os.stat(path)))
                super().end_headers()

            def copyfile(self, source, outputfile):
                if self.path.lstrip("/") in short:  # the connection drops half-way
                    outputfile.write(source.read(10))
                    self.close_connection = True
                    return
                super().copyfile(source, outputfile)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=folder))
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def served(tmp_path):
    folder = tmp_path / "www"
    folder.mkdir()
    server = Server(str(folder), short=("broken.jsonl",))
    yield folder, server.url
    server.close()


def same_size_edit(path) -> None:
    """Change one ground truth's digit, keeping the file's size and modification time (cp -p, rsync -t)."""
    st = os.stat(path)
    text = path.read_text()
    at = text.index('"ground_truth": "') + len('"ground_truth": "')
    path.write_text(text[:at] + str((int(text[at]) + 1) % 10) + text[at + 1 :])
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_size == st.st_size


def test_a_same_size_edit_of_a_dataset_on_a_web_server_without_etag_is_refused(storage, served):
    folder, url = served
    path = folder / "arith.jsonl"
    write_jsonl(path, arithmetic(24))
    assert pins.fingerprint(f"{url}/arith.jsonl") == pins.fingerprint(str(path))  # its bytes' sha256, as a file's
    base = init_run(storage, "r", config(f"task.dataset={url}/arith.jsonl"))
    assert base.manifest.summary["datasets"]["task.dataset"]["fingerprint"].startswith("sha256:")
    stage_function("snapshot")(storage, "r", 0)
    same_size_edit(path)
    with pytest.raises(
        StageError, match=r"^task\.dataset http://127\.0\.0\.1:\d+/arith\.jsonl changed since grpo init"
    ):
        stage_function("rollouts")(storage, "r", 0)


def test_a_run_pinned_by_size_alone_before_bytes_were_hashed_goes_on_while_the_size_holds(storage, served, caplog):
    folder, url = served
    path = folder / "arith.jsonl"
    write_jsonl(path, arithmetic(24))
    uri = f"{url}/arith.jsonl"
    base = init_run(storage, "old", config(f"task.dataset={uri}"))
    manifest = f"{base.attempt_dir}/_manifest.json"  # as grpo recorded an untagged URL before: its size alone
    raw = json.loads(storage.read_bytes(manifest))
    raw["summary"]["datasets"]["task.dataset"]["fingerprint"] = pins._size_only(uri)
    storage.write_bytes_atomic(manifest, json.dumps(raw).encode())
    pins.pin(None)
    with caplog.at_level(logging.WARNING, logger="grpo.data"):
        check_datasets(storage, "old")  # not "changed since grpo init": restoring could not help it
    assert "was pinned by its size alone when the run was made" in caplog.text
    write_jsonl(path, arithmetic(30))  # another size: changed
    with pytest.raises(StageError, match="changed since grpo init"):
        check_datasets(storage, "old")


def test_a_url_with_neither_a_content_tag_nor_bytes_that_read_whole_is_refused_at_init(storage, served, capsys):
    folder, url = served
    write_jsonl(folder / "broken.jsonl", arithmetic(24))
    rc, _, err = cli(
        storage,
        capsys,
        "init",
        "--run",
        "b",
        "--set",
        "task.name=arithmetic",
        "--set",
        f"task.dataset={url}/broken.jsonl",
    )
    assert rc == 2 and err.count("\n") == 1 and err.startswith("grpo: error: task.dataset: dataset http://"), err
    assert "gives no content tag (ETag, Content-MD5, a version id)" in err and "serve it with an ETag" in err
    assert not storage.exists(run_dir(storage, "b"))


@pytest.mark.parametrize("etag", ["nginx", "apache"])
def test_a_same_size_edit_behind_an_etag_of_size_and_time_is_refused(storage, tmp_path, etag):
    """nginx's and Apache's ETags are the file's size and mtime: an edit that keeps both keeps the ETag. The run is
    pinned by the bytes, and checked by them on each read."""
    folder = tmp_path / "www"
    folder.mkdir()
    write_jsonl(folder / "arith.jsonl", arithmetic(24))
    server = Server(str(folder), etag=etag)
    try:
        base = init_run(storage, "r", config(f"task.dataset={server.url}/arith.jsonl"))
        facts = base.manifest.summary["datasets"]["task.dataset"]
        assert facts["fingerprint"].startswith("sha256:") and "validator" not in facts
        stage_function("snapshot")(storage, "r", 0)
        same_size_edit(folder / "arith.jsonl")
        with pytest.raises(StageError, match=r"^task\.dataset http://127\.0\.0\.1:\d+/arith\.jsonl changed since"):
            stage_function("rollouts")(storage, "r", 0)
    finally:
        server.close()


def test_a_server_s_content_digest_checks_the_dataset_without_downloading_it(storage, tmp_path, monkeypatch):
    """An ETag that is the content's MD5 is recorded at init beside the bytes' sha256: a later read checks it with a
    metadata request, and an edit (a new MD5) is refused."""
    folder = tmp_path / "www"
    folder.mkdir()
    write_jsonl(folder / "arith.jsonl", arithmetic(24))
    server = Server(str(folder), etag="md5")
    try:
        base = init_run(storage, "r", config(f"task.dataset={server.url}/arith.jsonl"))
        facts = base.manifest.summary["datasets"]["task.dataset"]
        assert facts["fingerprint"] == pins.fingerprint(str(folder / "arith.jsonl"))  # the bytes, as a file's
        assert facts["validator"].endswith(hashlib.md5((folder / "arith.jsonl").read_bytes()).hexdigest())
        real = pins._content_digest
        monkeypatch.setattr(pins, "_content_digest", None)  # read, it would fail
        check_datasets(storage, "r")
        monkeypatch.setattr(pins, "_content_digest", real)
        same_size_edit(folder / "arith.jsonl")
        with pytest.raises(StageError, match="changed since grpo init"):
            check_datasets(storage, "r")
    finally:
        server.close()


# ---------------------------------------------------------------- 5c, 6. settings checked at grpo init


@pytest.mark.parametrize(
    "setting, says",
    [
        ("reward.shards=17", "reward.shards=17 is more than the iteration's 16 samples"),
        ("reward.timeout_s=0", "reward.timeout_s must be > 0"),
        ("reward.timeout_s=-1", "reward.timeout_s must be > 0"),
        ("rollout.temperature=0.001", "rollout.temperature must be >= 0.01"),
    ],
)
def test_settings_that_would_fail_later_fail_grpo_init_in_one_line_writing_nothing(storage, capsys, setting, says):
    tiny = ["rollout.prompts_per_iteration=8", "rollout.group_size=2", "learn.minibatch_size=16"]
    tiny += ["learn.microbatch_size=16"]
    with pytest.raises(ConfigError, match=says):
        load_config(None, tiny + [setting])
    rc, _, err = cli(storage, capsys, "init", "--run", "r", *[f"--set={s}" for s in tiny], "--set", setting)
    assert rc == 2 and err.count("\n") == 1 and says in err, err
    assert not storage.exists(run_dir(storage, "r"))


def test_reward_workers_beyond_the_samples_or_the_cores_are_refused_at_init(storage, monkeypatch):
    with pytest.raises(ConfigError, match=r"reward.workers=9 is more than the 8 samples a reward shard scores"):
        init_run(storage, "r", config("reward.workers=9", "reward.shards=2"))
    monkeypatch.setattr(stages.init, "usable_cores", lambda: 2)
    with pytest.raises(ConfigError, match=r"reward.workers=3 is more than the 2 CPU core\(s\)"):
        init_run(storage, "r", config("reward.workers=3"))
    assert not storage.exists(run_dir(storage, "r"))


def test_lora_target_modules_that_name_no_layer_of_the_model_are_refused_at_init(storage, capsys):
    rc, _, err = cli(storage, capsys, "init", "--run", "r", "--set", "learn.lora={target_modules: [q_proj, v_prj]}")
    assert rc == 2 and err.count("\n") == 1, err
    assert "learn.lora.target_modules: 'v_prj' names no linear layer of the model" in err and "q_proj" in err
    assert not storage.exists(run_dir(storage, "r"))


def test_an_eval_dataset_that_is_the_training_dataset_is_refused_at_init(storage, tmp_path):
    path = write_jsonl(tmp_path / "arith.jsonl", arithmetic(24))
    copy = write_jsonl(tmp_path / "copy.jsonl", arithmetic(24))
    with pytest.raises(ConfigError, match=r"eval.dataset .*arith.jsonl is task.dataset: every held-out prompt"):
        init_run(storage, "r", config(f"task.dataset={path}", f"eval.dataset={path}"))
    with pytest.raises(ConfigError, match=r"eval.dataset .*copy.jsonl has the same content as task.dataset"):
        init_run(storage, "r", config(f"task.dataset={path}", f"eval.dataset={copy}"))
    assert not storage.exists(run_dir(storage, "r"))


# ---------------------------------------------------------------- 5d. dynamic sampling on a constant reward

CONSTANT = """
def constant(response, ground_truth, prompt, **row):
    return 1.0
"""


def test_dynamic_sampling_stops_after_an_epoch_without_signal_and_says_the_reward_looks_constant(storage, tmp_path):
    (tmp_path / "constant.py").write_text(CONSTANT)
    path = write_jsonl(tmp_path / "arith.jsonl", arithmetic(24))  # 18 rows train (eval.split_fraction=0.25)
    dynamic = ["rollout.min_signal_groups=8", "rollout.max_sampling_rounds=50", "reward.truncated_reward=null"]
    extra = [f"reward.functions=[{tmp_path / 'constant.py'}:constant]", "eval.split_fraction=0.25"]
    init_run(storage, "r", config(f"task.dataset={path}", *dynamic, *extra))
    stage_function("snapshot")(storage, "r", 0)
    with pytest.raises(StageError) as e:
        stage_function("rollouts")(storage, "r", 0)
    message = str(e.value)
    assert "\n" not in message and "dynamic sampling stopped after 3 round(s), 24 prompts drawn" in message
    assert "a whole epoch of task.dataset's 18 training rows" in message and "the reward looks constant" in message
    assert "constant.py:constant" in message and "nothing committed" in message
    assert not committed_attempts(storage, stage_dir(storage, "r", 0, "rollouts"))


# ---------------------------------------------------------------- 7. status tells the truth


def status_rows(out: str) -> dict[str, list[str]]:
    return {line.split()[0]: line.split()[1:] for line in out.splitlines()[1:] if line.split()[0].isdigit()}


def test_iterations_after_a_forced_older_stage_show_as_stale(storage, capsys):
    make_run(storage, "r")
    for _ in run_warm(storage, "r", 0, 2):
        pass
    stage_function("advantages")(storage, "r", 0, force=True)
    rc, out, _ = cli(storage, capsys, "status", "--run", "r")
    rows = status_rows(out)
    assert rc == 0 and rows["0"] == ["ok", "x1"] * 3 + ["ok", "x2", "stale", "x1", "stale", "x1"], out
    assert rows["1"] == ["stale", "x1"] * 6, out  # made from a policy the stale learn 0 made
    assert next_iteration(storage, "r") == 0


def test_shards_show_in_status_verify_checks_them_and_gc_collects_their_merged_tables(storage, capsys):
    init_run(storage, "many", load_config(None, CHUNKED + SHARDED))
    run_iteration(storage, "many", 0)
    rc, out, _ = cli(storage, capsys, "status", "--run", "many", "--verify")
    assert rc == 0 and "iteration 0 shards: rollouts 0 ok x1, 1 ok x1, 2 ok x1; rewards 0 ok x1, 1 ok x1" in out, out

    shard = latest_committed(storage, stage_dir(storage, "many", 0, shard_stage("rewards", 1, 2))).attempt_dir
    table = f"{shard}/rewards.parquet"
    good = storage.fs.cat_file(table)
    storage.fs.pipe_file(table, good[:20] + bytes([good[20] ^ 1]) + good[21:])  # edited after the commit
    rc, out, err = cli(storage, capsys, "status", "--run", "many", "--verify")
    assert rc == 2 and "rewards 0 ok x1, 1 corrupt x1" in out, out
    assert "grpo stage rewards --run many --iteration 0 --shard 1 --force" in err
    storage.fs.pipe_file(table, good)

    rc, out, _ = cli(storage, capsys, "gc", "--run", "many")
    merged_lines = [line for line in out.splitlines() if line.split()[0] == "merged"]
    assert rc == 0 and len(merged_lines) == 5 and "nothing removed" in out, out  # 3 + 2 shard tables
    rc, out, _ = cli(storage, capsys, "gc", "--run", "many", "--delete")
    assert rc == 0 and "removed 5 item(s)" in out
    assert not storage.exists(table) and "rewards.parquet" in read_collected(storage, shard)
    merged = latest_committed(storage, stage_dir(storage, "many", 0, "rewards")).uri
    assert read_collected(storage, shard)["rewards.parquet"]["why"] == f"shard table merged into {merged}"
    rc, out, _ = cli(storage, capsys, "status", "--run", "many", "--verify")  # collected, not corrupt
    assert rc == 0 and "rewards 0 ok x1, 1 ok x1" in out
    rc, out, _ = cli(storage, capsys, "query", "--run", "many", "SELECT count(*) AS n FROM rewards")
    assert rc == 0 and out.split()[-1] == "64"
    assert " merged " not in cli(storage, capsys, "gc", "--run", "many")[1]  # gone once
    assert run_iteration(storage, "many", 0)["rewards"].uri == merged  # the run reuses what it merged
    assert json.loads(storage.read_bytes(f"{shard}/collected.json"))["files"]
