"""reward.judge (grpo/scoring/judge.py): an OpenAI-compatible endpoint served here by a thread whose answers each test
scripts (verdicts, text that does not parse, 500s before an answer), recording every request; a local tiny model
that cannot write the format; ranking; the cache across reruns and `grpo rescore`; bad settings refused at init."""

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pyarrow.parquet as pq
import pytest
import yaml
from test_stages import make_run

from flows.cli import main
from grpo.config import ConfigError, load_config
from grpo.query import query
from grpo.record.layout import stage_dir
from grpo.record.storage import latest_committed, open_storage
from grpo.scoring import judge as judge_engine
from grpo.scoring.judge_format import prompt_hash
from stages import StageError, stage_function
from stages.iteration import run_iteration

RUBRIC = [
    "reward.judge.criteria=[{name: sorted, weight: 3, description: ascending order}, {name: brief, weight: 1}]",
    "reward.judge.verdicts=[fail, pass]",
    "reward.judge.verdict_scores=[0, 1]",
]


def digest(text: str) -> int:
    return int(hashlib.sha256(text.encode()).hexdigest(), 16)


class Judge:
    """The scripted endpoint: for a rubric prompt, `verdict` of the response's text (None: an answer that does not
    parse); a response whose digest is 0 mod 7 gets `failures` 500s first; ranking prompts are ranked as listed
    reversed. Records each request's messages and the most requests in flight at once."""

    def __init__(self):
        self.requests, self.lock, self.in_flight, self.most = [], threading.Lock(), 0, 0
        self.failures, self.failed, self.down = 1, {}, False
        self.meet = threading.Barrier(2, timeout=60)  # the first two requests wait for each other: overlap forced
        self.verdict = lambda response: ("pass" if digest(response) % 3 else "fail") if digest(response) % 5 else None

    def answer(self, body: dict) -> tuple[int, str]:
        text = body["messages"][0]["content"]
        if self.down:
            return 503, "down"
        if "RANKING" in text:
            n = int(text.split("You rank ")[1].split()[0])
            return 200, "REASON 1: first\nRANKING: " + ", ".join(str(i) for i in range(n, 0, -1))
        response = text.split("Response:\n", 1)[1].split("\n\nCriteria:", 1)[0]
        key = prompt_hash(text, body["max_tokens"], body["temperature"])
        if digest(response) % 7 == 0 and self.failed.get(key, 0) < self.failures:
            self.failed[key] = self.failed.get(key, 0) + 1
            return 500, "overloaded"
        verdict = self.verdict(response)
        if verdict is None:
            return 200, "I cannot judge this."
        return 200, f"REASON sorted: looked\nVERDICT sorted: {verdict}\nREASON brief: short\nVERDICT brief: pass"

    def serve(self):
        judge = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with judge.lock:
                    judge.requests.append(body | {"auth": self.headers.get("Authorization")})
                    judge.in_flight += 1
                    judge.most, first = max(judge.most, judge.in_flight), len(judge.requests) <= 2
                try:
                    if first:
                        judge.meet.wait()
                    status, content = judge.answer(body)
                finally:
                    with judge.lock:
                        judge.in_flight -= 1
                out = {"choices": [{"message": {"role": "assistant", "content": content}}]} if status == 200 else {}
                data = json.dumps(out).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.server.server_port}/v1"


@pytest.fixture(scope="module")
def endpoint():
    judge = Judge()
    url = judge.serve()
    yield judge, url
    judge.server.shutdown()


def judged_run(storage, run_id, url, extra=()):
    settings = [
        f"reward.judge.url={url}",
        "reward.judge.model_name=scripted",
        "reward.judge.api_key_env=JUDGE_TEST_KEY",
        "reward.judge.concurrency=3",
        "reward.judge.parse_error_reward=0.1",
        "reward.weights=[0, 1]",  # the judge alone; the task's reward still committed as a component
        "reward.max_error_fraction=0.5",
        "reward.truncated_reward=null",  # every reward is the judge's score
        *RUBRIC,
        *extra,
    ]
    return make_run(storage, run_id, extra=settings)


def stage(storage, run_id, k, name, force=False):
    return stage_function(name)(storage, run_id, k, force=force)


def sampled(storage, run_id):
    """Iteration 0 of `run_id` sampled (its snapshot and rollouts committed): its rewards stage is next."""
    for name in ("snapshot", "rollouts"):
        stage(storage, run_id, 0, name)


def table(committed, name):
    return pq.read_table(committed.path(name).replace("file://", "")).to_pandas()


@pytest.fixture(scope="module")
def judged(endpoint, tmp_path_factory):
    """Run j, iteration 0 whole with the scripted endpoint judging: (storage, the judge, its url)."""
    judge, url = endpoint
    storage = open_storage((tmp_path_factory.mktemp("judge") / "store").as_uri())
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JUDGE_TEST_KEY", "sk-test-0123456789")
        judged_run(storage, "j", url)
        run_iteration(storage, "j", 0)
    return storage, judge, url


def test_an_endpoint_judge_commits_every_call_and_its_score(judged):
    storage, judge, _ = judged
    rewards = latest_committed(storage, stage_dir(storage, "j", 0, "rewards"))
    rows, calls = table(rewards, "rewards.parquet"), table(rewards, "judge.parquet")
    assert len(calls) == len(rows) == 64 and (calls.prompt_id.values == rows.prompt_id.values).all()
    assert 2 <= judge.most <= 3 and all(r["auth"] == "Bearer sk-test-0123456789" for r in judge.requests)
    asked = {prompt_hash(r["messages"][0]["content"], r["max_tokens"], r["temperature"]) for r in judge.requests}
    assert set(calls.prompt_hash) == asked  # every row's call, keyed by what was sent
    distinct, retried = calls.prompt_hash.nunique(), sum(judge.failed.values())  # a response twice: one call
    assert retried > 0 and len(judge.requests) == distinct + retried
    assert calls.drop_duplicates("prompt_hash").attempts.sum() == distinct + retried
    unparsed = calls.error.notna()
    assert 0 < unparsed.sum() < 64 and calls.raw.notna().all()  # the answers that do not parse, committed as written
    assert (calls.score[unparsed] == 0.1).all() and calls.verdicts[unparsed].isna().all()
    for (_, c), (_, r) in zip(calls.iterrows(), rows.iterrows()):
        comps = dict(r.components)
        assert (
            not isinstance(r.error, str)
            and r.reward == pytest.approx(c.score)
            and comps["judge"] == c.score
            and "sort" in comps
        )
        if not isinstance(c.error, str):  # weights 3 and 1: sorted yes/no with brief yes
            assert [v["criterion"] for v in c.verdicts] == ["sorted", "brief"] and c.score in (0.25, 1.0)
            assert c.verdicts[0]["reason"] == "looked"
    summary = rewards.manifest.summary
    assert (
        summary["judge_errors"] == calls[unparsed].prompt_hash.nunique()
        and summary["judge_calls"] == distinct
        and summary["errors"] == 0
    )
    assert summary["judge_failed"] == 0 and summary["judge_cached"] == 0
    seen = query(storage, "j", "SELECT count(*) AS n, count(*) FILTER (WHERE error IS NOT NULL) AS e FROM judge")
    assert seen.n[0] == 64 and seen.e[0] == unparsed.sum()
    stored = [p for p in storage.fs.find(storage.root) if not p.endswith((".safetensors", ".bin"))]
    assert not [p for p in stored if b"sk-test-0123456789" in storage.read_bytes(p)]  # the key: never committed


def test_a_rescore_with_the_same_judge_makes_no_call(judged, capsys, monkeypatch):
    storage, judge, _ = judged
    monkeypatch.setenv("JUDGE_TEST_KEY", "sk-test-0123456789")
    before = len(judge.requests)
    # a new parse_error_reward: every sample rescored from the cache, the unparsed ones changed
    rc = main(["--storage", storage.url, "rescore", "--run", "j", "--iterations", "0:0", "--as", "j-r",
               "--set", "reward.judge.parse_error_reward=0.7"])  # fmt: skip
    assert rc == 0, capsys.readouterr().err
    assert len(judge.requests) == before
    fork = latest_committed(storage, stage_dir(storage, "j-r", 0, "rewards"))
    assert fork.manifest.summary["judge_calls"] == 0 and table(fork, "judge.parquet").cached.all()
    changed = query(storage, "j-r", "SELECT count(*) FILTER (WHERE reward_changed) AS n FROM rescore")
    errors = query(storage, "j", "SELECT count(*) AS n FROM judge WHERE error IS NOT NULL")
    assert changed.n[0] == errors.n[0] > 0


def test_a_rescore_with_a_new_rubric_judges_history_again(judged, capsys, monkeypatch):
    storage, judge, _ = judged
    monkeypatch.setenv("JUDGE_TEST_KEY", "sk-test-0123456789")
    before = len(judge.requests)
    new = "reward.judge.criteria=[{name: sorted, weight: 1, description: ascending}, {name: brief, weight: 1}]"
    rc = main(["--storage", storage.url, "rescore", "--run", "j", "--iterations", "0:0", "--as", "j-n", "--set", new])
    assert rc == 0, capsys.readouterr().err
    asked = judge.requests[before:]
    distinct = table(latest_committed(storage, stage_dir(storage, "j", 0, "rewards")), "judge.parquet").prompt_hash
    assert len(asked) >= distinct.nunique() and all("sorted (weight 1)" in r["messages"][0]["content"] for r in asked)
    fork = latest_committed(storage, stage_dir(storage, "j-n", 0, "rewards"))
    scores = set(table(fork, "judge.parquet").score)
    assert scores <= {0.5, 1.0, 0.1} and 0.5 in scores  # weights 1 and 1 now: sorted no, brief yes = 0.5


def test_a_reference_guided_template_sends_each_rows_ground_truth(judged, capsys, monkeypatch):
    from grpo.scoring.judge_format import RUBRIC_TEMPLATE

    storage, judge, _ = judged
    monkeypatch.setenv("JUDGE_TEST_KEY", "sk-test-0123456789")
    before = len(judge.requests)
    guided = RUBRIC_TEMPLATE + "\n\nThe correct answer is <<{reference}>>."
    rc = main(["--storage", storage.url, "rescore", "--run", "j", "--iterations", "0:0", "--as", "j-g",
               "--set", f"reward.judge.template={guided}"])  # fmt: skip
    assert rc == 0, capsys.readouterr().err
    sent = {}  # (prompt, response) -> the message asked
    for r in judge.requests[before:]:
        text = r["messages"][0]["content"]
        prompt, rest = text.split("Prompt:\n", 1)[1].split("\n\nResponse:\n", 1)
        sent[prompt, rest.split("\n\nCriteria:")[0]] = text
    rollouts = table(latest_committed(storage, stage_dir(storage, "j", 0, "rollouts")), "rollouts.parquet")
    asked = list(zip(rollouts.prompt, rollouts.response))
    assert set(sent) == set(asked)  # every response judged again: a new prompt, no cache hit
    for key, truth in zip(asked, rollouts.ground_truth):
        assert sent[key].endswith(f"The correct answer is <<{truth}>>.") and truth.strip()
    old = table(latest_committed(storage, stage_dir(storage, "j", 0, "rewards")), "judge.parquet")
    new = table(latest_committed(storage, stage_dir(storage, "j-g", 0, "rewards")), "judge.parquet")
    assert not set(old.prompt_hash) & set(new.prompt_hash)  # the cache key holds the reference


def test_the_docs_judge_yaml_is_a_config_and_their_sql_runs(judged):
    from test_readme import code_blocks

    from tests.doc_pages import page

    storage, _, url = judged
    blocks = code_blocks(page("teachers-and-judges.md"))
    settings = yaml.safe_load(next(body for lang, body in blocks if lang == "yaml" and "judge:" in body))
    assert load_config(settings).reward.judge.url == "http://localhost:8000/v1"
    guided = yaml.safe_load(next(body for lang, body in blocks if lang == "yaml" and "{reference}" in body))
    assert "{reference}" in load_config(guided).reward.judge.template  # a template init takes
    disagree, drift = [query(storage, "j", body) for lang, body in blocks if lang == "sql"]
    assert disagree.judged[0] == 64 and 0 <= disagree.disagreement[0] <= 1 and disagree.unparsed[0] > 0
    assert drift.tokens[0] > 0 and 0 <= drift.judge_score[0] <= 1


def test_a_rerun_rewards_stage_makes_no_call(judged, monkeypatch):
    storage, judge, _ = judged
    monkeypatch.setenv("JUDGE_TEST_KEY", "sk-test-0123456789")
    before = len(judge.requests)
    again = stage(storage, "j", 0, "rewards", force=True)
    assert again.manifest.summary["judge_calls"] == 0 and again.manifest.summary["judge_cached"] > 0
    assert table(again, "judge.parquet").cached.all() and len(judge.requests) == before


def test_a_failing_endpoint_fails_the_stage_and_the_rerun_calls_only_what_is_missing(endpoint, tmp_path, monkeypatch):
    judge, url = endpoint
    monkeypatch.setenv("JUDGE_TEST_KEY", "sk-test-0123456789")
    monkeypatch.setattr(judge_engine, "_BACKOFF_S", 0.0)
    monkeypatch.setattr(judge, "failures", 0)  # no scripted 500s: each call is answered or the endpoint is down
    storage = open_storage((tmp_path / "store").as_uri())
    judged_run(storage, "f", url, ["reward.judge.retries=0"])
    sampled(storage, "f")
    answered = []
    real = judge.answer

    def half_down(body):  # the endpoint goes down after 20 answers
        if len(answered) >= 20:
            return 503, "down"
        status, content = real(body)
        if status == 200:
            answered.append(body)
        return status, content

    monkeypatch.setattr(judge, "answer", half_down)
    with pytest.raises(StageError, match="max_error_fraction"):
        stage(storage, "f", 0, "rewards")
    monkeypatch.setattr(judge, "answer", real)
    before = len(judge.requests)
    done = stage(storage, "f", 0, "rewards")
    distinct = table(done, "judge.parquet").prompt_hash.nunique()
    assert done.manifest.summary["judge_cached"] == 20 and done.manifest.summary["judge_calls"] == distinct - 20
    assert len(judge.requests) - before == distinct - 20


def test_shards_judge_their_rows_and_commit_them_merged(endpoint, tmp_path, monkeypatch):
    judge, url = endpoint
    monkeypatch.setenv("JUDGE_TEST_KEY", "sk-test-0123456789")
    storage = open_storage((tmp_path / "store").as_uri())
    judged_run(storage, "s", url, ["reward.shards=2"])
    sampled(storage, "s")
    done = stage(storage, "s", 0, "rewards")
    calls, rows = table(done, "judge.parquet"), table(done, "rewards.parquet")
    assert len(calls) == len(rows) == 64 and (calls.sample_index.values == rows.sample_index.values).all()
    summary = done.manifest.summary
    assert summary["shards"] == 2 and summary["judge_calls"] + summary["judge_cached"] >= calls.prompt_hash.nunique()
    assert summary["judge_errors"] == calls[calls.error.notna()].prompt_hash.nunique()


def test_ranking_makes_one_call_per_group(endpoint, tmp_path, monkeypatch):
    judge, url = endpoint
    monkeypatch.setenv("JUDGE_TEST_KEY", "sk-test-0123456789")
    storage = open_storage((tmp_path / "store").as_uri())
    judged_run(storage, "r", url, ["reward.judge.mode=ranking"])
    sampled(storage, "r")
    before = len(judge.requests)
    done = stage(storage, "r", 0, "rewards")
    calls = table(done, "judge.parquet")
    assert len(judge.requests) - before == 16 and done.manifest.summary["judge_calls"] == 16  # 16 groups of 4
    assert (calls.groupby("prompt_id").prompt_hash.nunique() == 1).all()
    for _, c in calls.iterrows():  # ranked as listed reversed: sample i of 4 has rank 4 - i
        assert c.verdicts[0]["verdict"] == str(4 - c.sample_index) and c.score == pytest.approx(c.sample_index / 3)
    assert calls[calls.sample_index == 0].verdicts.map(lambda v: v[0]["reason"]).eq("first").all()


def test_a_local_judge_that_cannot_write_the_format_scores_the_configured_reward(tmp_path):
    from grpo.tiny_model import build_chat_model

    folder = build_chat_model(str(tmp_path / "judge-model"), ["VERDICT correct: yes", "REASON correct: fine"])
    storage = open_storage((tmp_path / "store").as_uri())
    # one token per answer: no answer can hold a REASON and a VERDICT line
    settings = [f"reward.judge.model={folder}", "reward.judge.max_tokens=1", "reward.judge.parse_error_reward=0.25",
                "reward.weights=[1, 2]", "reward.truncated_reward=null"]  # fmt: skip
    make_run(storage, "l", extra=settings)
    sampled(storage, "l")
    done = stage(storage, "l", 0, "rewards")
    calls, rows = table(done, "judge.parquet"), table(done, "rewards.parquet")
    assert done.manifest.summary["judge_errors"] == calls.prompt_hash.nunique() and done.manifest.summary["errors"] == 0
    assert calls.error.notna().all() and (calls.score == 0.25).all()
    assert calls.raw.notna().all() and calls.judge_revision.str.startswith("folder:").all()
    comps = rows.components.map(dict)
    assert (rows.reward == comps.map(lambda c: c["sort"] + 2 * 0.25)).all()
    again = stage(storage, "l", 0, "rewards", force=True)  # the cache: no model call
    assert again.manifest.summary["judge_calls"] == 0
    assert stage(storage, "l", 0, "rewards").attempt_dir == again.attempt_dir  # the same judge: the commit reused
    (tmp_path / "judge-model" / "retrained.txt").write_text("new weights would do the same")
    changed = stage(storage, "l", 0, "rewards")  # another judge revision: a new attempt, judged by it
    assert changed.attempt_dir != again.attempt_dir and changed.manifest.summary["judge_calls"] > 0
    revisions = set(table(changed, "judge.parquet").judge_revision) | set(calls.judge_revision)
    assert len(revisions) == 2


@pytest.mark.parametrize(
    "bad, says",
    [
        (["reward.judge.url=http://x/v1"], "reward.judge.model_name"),
        (["reward.judge.model=m", "reward.judge.url=http://x/v1"], "set model"),
        (["reward.judge.model=m", "reward.judge.template=Grade {response}"], "reward.judge.template: missing"),
        (
            ["reward.judge.model=m", "reward.judge.template=Grade {prompt} {response} {criteria} {verdicts} {answer}"],
            "reward.judge.template: unknown {answer}",
        ),
        (["reward.judge.model=m", "reward.judge.verdict_scores=[0, 2, 1]"], "reward.judge.verdict_scores"),
        (["reward.judge.model=m", "reward.weights=[1]"], "reward.weights"),
        (["reward.judge.model=m", "reward.judge.mode=ranking", "reward.shards=2"], "mode=ranking"),
    ],
)
def test_bad_judge_settings_are_refused_in_one_line_at_init(bad, says, tmp_path, capsys):
    with pytest.raises(ConfigError, match=says):
        load_config(None, bad)
    sets = [a for s in bad for a in ("--set", s)]
    rc = main(["--storage", (tmp_path / "store").as_uri(), "init", "--run", "b", *sets])
    err = capsys.readouterr().err
    assert rc == 2 and says in err and err.count("\n") == 1
    assert not (tmp_path / "store" / "runs" / "b").exists()  # nothing written


def test_a_local_judge_folder_that_is_not_there_is_refused_at_init(tmp_path, capsys):
    missing = tmp_path / "no-judge"
    rc = main(
        ["--storage", (tmp_path / "store").as_uri(), "init", "--run", "m", "--set", f"reward.judge.model={missing}"]
    )
    err = capsys.readouterr().err
    assert rc == 2 and f"reward.judge.model: no folder at {missing}" in err and err.count("\n") == 1
    assert not (tmp_path / "store" / "runs" / "m").exists()


def test_ranking_fills_each_groups_reference():
    from grpo.config import JudgeConfig

    cfg = JudgeConfig(model="m", mode="ranking", template="{n} {prompt} {responses} ref={reference}")
    rows = [
        {"prompt_id": p, "sample_index": s, "prompt": f"p{p}", "response": f"r{p}{s}", "ground_truth": f"t{p}"}
        for p in (0, 1)
        for s in (1, 0)
    ]
    calls = judge_engine._calls(cfg, rows)
    assert [(m.split()[0], m.rsplit("ref=", 1)[1], members) for m, _, members in calls] == [
        ("2", "t0", [1, 0]),
        ("2", "t1", [3, 2]),
    ]
    plain = judge_engine._calls(JudgeConfig(model="m", mode="ranking"), rows)
    assert "t0" not in plain[0][0] and plain[0][1] != calls[0][1]


def test_gc_removes_the_judge_answers_no_committed_table_refers_to(judged, capsys, monkeypatch):
    from grpo.scoring.judge_cache import CACHE_FOLDER, referred
    from stages.common import load_run

    storage, _, _ = judged
    monkeypatch.setenv("JUDGE_TEST_KEY", "sk-test-0123456789")
    committed = table(latest_committed(storage, stage_dir(storage, "j", 0, "rewards")), "judge.parquet")
    # a rewards stage killed after paying for two calls: their answers are cached, in no committed table
    rows = [{"prompt_id": 0, "sample_index": s, "prompt": "sort 3 1 2", "response": f"never committed {s}",
             "ground_truth": "1 2 3"} for s in range(2)]  # fmt: skip
    judge_engine.judged(storage, load_run(storage, "j").reward.judge, rows)
    mixed = judge_engine.JudgeCache(storage, committed.judge_revision[0])  # a file of one answer of each kind
    mixed.add(committed.prompt_hash[0], "REASON sorted: x\nVERDICT sorted: pass", 1)
    mixed.add("0" * 64, "an answer to a prompt since rewritten", 1)
    mixed.flush()

    def answers() -> list[tuple[str, str]]:
        return sorted(
            (p.rsplit("/", 2)[-2], json.loads(line)["prompt_hash"])
            for p in storage.fs.find(storage.path(CACHE_FOLDER))
            for line in storage.read_bytes(p).decode().splitlines()
        )

    before = answers()
    out = gc_lines(storage, capsys, "--run", "j")  # everything written within the hour: left alone
    assert "judge-cache files newer than 1 h left alone" in out and " judge " not in out
    out = gc_lines(storage, capsys, "--run", "j", "--older-than-s", "0")
    listed = [line for line in out.splitlines() if line.split()[0] == "judge"]
    assert len(listed) == 2 and sum("; 1 kept" in line for line in listed) == 1 and answers() == before  # dry run
    gc_lines(storage, capsys, "--run", "j", "--older-than-s", "0", "--delete")
    after = answers()
    assert len(set(before) - set(after)) == 3 and set(after) == referred(storage)  # each committed answer stays
    assert stage(storage, "j", 0, "rewards", force=True).manifest.summary["judge_calls"] == 0


def gc_lines(storage, capsys, *args) -> str:
    assert main(["--storage", storage.url, "gc", *args]) == 0
    return capsys.readouterr().out
