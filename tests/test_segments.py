"""Partial rollouts (issue 42): with rollout.segment_tokens B an iteration samples at most B new tokens per response and
carries what has not ended to the next iteration, which continues it from exactly its ids with its own policy; only
complete groups reach rewards and learn, the oldest first, fixed by the config and the seed; every token records the
policy version that sampled it, and the learn's token ages are read from them; a run killed with responses carried
resumes to the bytes of a run never stopped; fork and rescore see carried responses as they were."""

from collections import Counter

import pandas as pd
import pytest
from kill_points import kill_iterations_at
from test_learn import F32, TINY

from flows.cli import main
from grpo.config import ConfigError, load_config
from grpo.episodes.records import Episode, end_of
from grpo.query import query
from grpo.record.identity import section
from grpo.record.layout import STAGES, stage_dir
from grpo.record.lineage import policy_version
from grpo.record.storage import committed_attempts, latest_committed, list_attempts, open_storage
from grpo.report import iteration_rows
from grpo.sampling.engines import close_generators
from grpo.sampling.hf import HFGenerator
from stages import learn, segments
from stages.init import init_run
from stages.iteration import run_iteration

pytestmark = [pytest.mark.e2e, pytest.mark.precision_pinned]  # every learner here pins float32
G, N = 4, 16
RUN = TINY + [F32, "learn.minibatch_size=4", "learn.microbatch_size=4", "learn.epochs=1", "rollout.max_tokens=12"]
SEGMENTED = RUN + ["rollout.segment_tokens=3"]


def cold():
    """What a new process has: no warm learner, no sampling engine."""
    learn.WARM.take(None)
    close_generators()


def table(storage, run_id: str, k: int, name: str) -> pd.DataFrame:
    return pd.read_parquet(storage.uri(committed(storage, run_id, k, "rollouts").path(f"{name}.parquet")))


def committed(storage, run_id, k, stage):
    return latest_committed(storage, stage_dir(storage, run_id, k, stage))


def committed_files(storage, run_id: str, iterations: int) -> dict:
    """{(iteration, stage): [(file, sha256)]} of the newest committed attempt of every stage."""
    return {
        (k, s): sorted((f.path, f.sha256) for f in committed(storage, run_id, k, s).manifest.files)
        for k in range(iterations)
        for s in STAGES
    }


class Spy:
    """Every sampler call, by the iteration whose rollouts made it: {iteration: {context: [(ids, log-probs)]}}."""

    def __init__(self, monkeypatch, cls=HFGenerator):
        self.calls: dict[int, dict[tuple, list]] = {}
        self.iteration = None
        generate = cls.generate

        def spied(gen, prompts, spec, budgets=None, progress=None, seeds=None):
            out = generate(gen, prompts, spec, budgets, progress, seeds)
            for context, [sample] in zip(prompts, out):
                at = self.calls.setdefault(self.iteration, {}).setdefault(tuple(context), [])
                at.append((list(sample.response_ids), list(sample.logprobs)))
            return out

        monkeypatch.setattr(cls, "generate", spied)

    def _find(self, k: int, context: tuple, ids: list[int]) -> int | None:
        given = self.calls.get(k, {}).get(context, [])
        return next((i for i, (got, _) in enumerate(given) if got and got == ids[: len(got)]), None)

    def has(self, k: int, context: tuple, ids: list[int]) -> bool:
        """Whether iteration k continued `context` with ids that begin `ids` (what was left of the response)."""
        return self._find(k, context, ids) is not None

    def take(self, k: int, context: tuple, ids: list[int]) -> tuple[list[int], list[float]]:
        """That call's (ids, log-probs), used up."""
        return self.calls[k][context].pop(self._find(k, context, ids))


@pytest.fixture(scope="module")
def segmented(tmp_path_factory):
    """A segmented run of 4 iterations, every sampler call seen; and its storage."""
    mp = pytest.MonkeyPatch()
    spy = Spy(mp)
    storage = open_storage((tmp_path_factory.mktemp("seg") / "store").as_uri())
    init_run(storage, "s", load_config(None, SEGMENTED))
    cold()
    for k in range(4):
        spy.iteration = k
        run_iteration(storage, "s", k)
    mp.undo()
    return storage, spy


def test_every_released_row_is_its_segments_token_in_token_out_each_token_by_its_iteration(segmented):
    """Each released row, walked from the iteration its group started to the one that released it: each iteration
    continued it from exactly its prompt's ids and the ids before (the sampler's context), sampled at most B ids, and
    the row holds them, their log-probs as the sampler gave them and that iteration's policy version per token."""
    storage, spy = segmented
    carried_over = spans = 0  # the segments sampled in a later iteration; those the rows' policy versions say there are
    for k in range(4):
        rows = table(storage, "s", k, "rollouts")
        assert len(rows) and (rows.iteration == k).all()
        for row in rows.itertuples():
            ids, logps, versions = list(row.response_ids), list(row.sampler_logprobs), list(row.token_versions)
            assert len(ids) == len(logps) == len(versions) == len(row.loss_mask) and set(row.loss_mask) == {1}
            at, started = 0, row.prompt_id // N
            for j in range(started, k + 1):
                while at < len(ids) and spy.has(j, context := tuple(list(row.prompt_ids) + ids[:at]), ids[at:]):
                    got, their_logps = spy.take(j, context, ids[at:])  # one round's segment: at most B ids
                    assert 0 < len(got) <= 3 and logps[at : at + len(got)] == pytest.approx(their_logps, abs=1e-6)
                    assert versions[at : at + len(got)] == [policy_version(j, 0)] * len(got)
                    at += len(got)
                    carried_over += j > started
            assert at == len(ids)  # and nothing else was appended
            assert row.policy_version == max(versions)
            spans += len(set(versions)) - 1
            assert row.finish_reason == "stop" or len(ids) == 12  # cut off at rollout.max_tokens only
    assert carried_over >= spans > 0  # responses did cross iterations (how many is the sampling's on this CPU)


def test_only_complete_groups_go_on_the_oldest_first_and_the_rest_is_carried_whole(segmented):
    storage, _ = segmented
    for k in range(4):
        rows, carried, segs = (table(storage, "s", k, t) for t in ("rollouts", "carried", "segments"))
        summary = committed(storage, "s", k, "rollouts").manifest.summary
        assert rows.groupby("prompt_id").size().eq(G).all() and rows.finish_reason.notna().all()
        complete = carried.groupby("prompt_id").finish_reason.apply(lambda f: f.notna().all())
        released = rows.prompt_id.unique()
        if len(released) < N:  # fewer than N taken only where no complete group was left behind
            assert not complete.any()
        assert all(released.max() < p for p in complete[complete].index)  # the oldest complete groups first
        assert summary["groups_released"] == len(released) and summary["samples"] == len(rows)
        assert summary["responses_carried"] == carried.finish_reason.isna().sum()
        assert summary["responses_waiting"] == carried.finish_reason.notna().sum()
        assert Counter(segs.state) == {
            "released": len(rows), "carried": summary["responses_carried"], "finished": summary["responses_waiting"],
        }  # fmt: skip
        unfinished = carried[carried.finish_reason.isna()]
        ages = Counter(k - unfinished.prompt_id // N)
        assert summary["carried_ages"] == {str(a): n for a, n in sorted(ages.items())}
        rewarded = pd.read_parquet(storage.uri(committed(storage, "s", k, "rewards").path("rewards.parquet")))
        assert sorted(zip(rewarded.prompt_id, rewarded.sample_index)) == sorted(zip(rows.prompt_id, rows.sample_index))
        if k:  # what k - 1 carried is here: released, carried again or finished, never lost nor sampled afresh
            before = table(storage, "s", k - 1, "carried")
            held = set(zip(segs.prompt_id, segs.sample_index))
            assert set(zip(before.prompt_id, before.sample_index)) <= held
            assert len(segs) == len(before) + N * G


def test_the_learn_reads_each_tokens_age_from_its_version(segmented):
    """learn k updates from version k - 1: its token_ages are that minus each released token's version."""
    storage, _ = segmented
    ages_seen = set()
    for k in range(4):
        rows = table(storage, "s", k, "rollouts")
        expected = Counter(k - 1 - v for versions in rows.token_versions for v in versions)
        got = committed(storage, "s", k, "learn").manifest.summary["token_ages"]
        assert got == {str(a): n for a, n in sorted(expected.items())}
        ages_seen |= set(expected)
    assert ages_seen >= {0, 1}


def test_at_staleness_1_each_token_is_its_iterations_stale_policy_and_the_learn_corrects_by_its_own_logprob(tmp_path):
    """S = 1: iteration j samples learn j - 2's policy, so every token's version is policy_version(j, 1) of the
    iteration that sampled it, every trained token is at least 1 old, and the behaviour weights read each token's own
    sampler log-prob (the learn's sampler KL and weights are those of the committed per-token log-probs)."""
    storage = open_storage((tmp_path / "s1").as_uri())
    init_run(storage, "s", load_config(None, SEGMENTED + ["rollout.staleness=1", "learn.behavior_correction=tis"]))
    cold()
    for k in range(3):
        run_iteration(storage, "s", k)
        segs = table(storage, "s", k, "segments")
        assert (segs.policy_version == policy_version(k, 1)).all()
        rows = table(storage, "s", k, "rollouts")
        versions = Counter(v for vs in rows.token_versions for v in vs)
        assert set(versions) <= {policy_version(j, 1) for j in range(k + 1)}
        ages = committed(storage, "s", k, "learn").manifest.summary["token_ages"]
        assert ages == {str(k - 1 - v): n for v, n in sorted(versions.items(), reverse=True)}
        assert min(map(int, ages)) >= 1 or k == 0  # learn 0 starts from the base, which sampled iteration 0


def test_the_oldest_complete_groups_are_released_in_whole_minibatches_and_the_rest_carried():
    """hold: of groups 0-6 (G = 2), the complete ones are 1, 2, 4, 5, 6; a learn of N = 4 groups in minibatches of 2
    takes 1, 2, 4, 5; group 6 (complete), 0 and 3 (a response unfinished) are carried whole, finished ones included;
    with only 3 complete, one minibatch of 2."""

    def response(pid: int, j: int, finish: str | None) -> Episode:
        end = None if finish is None else end_of(finish)
        return Episode(pid, j, None, "p", [1], budget=8, response_ids=[5], logprobs=[0.0], loss_mask=[1], end=end)

    unfinished = {(0, 1), (3, 0)}
    rs = [response(p, j, None if (p, j) in unfinished else "stop") for p in (6, 5, 4, 3, 2, 1, 0) for j in (1, 0)]
    held = segments.hold(rs, n=4, per_step=2)
    assert [[(x.prompt_id, x.sample_index) for x in grp] for grp in held.release] == [
        [(p, 0), (p, 1)] for p in (1, 2, 4, 5)
    ]
    assert [(x.prompt_id, x.sample_index) for x in held.carry] == [(0, 0), (0, 1), (3, 0), (3, 1), (6, 0), (6, 1)]
    assert len(held.responses) == 14
    few = segments.hold([x for x in rs if x.prompt_id in (0, 1, 2, 3, 4)], n=4, per_step=2)
    assert [grp[0].prompt_id for grp in few.release] == [1, 2]  # 3 complete: one whole minibatch, the oldest


def test_query_report_and_timeline_show_what_was_carried(segmented, capsys):
    storage, _ = segmented
    sql = "SELECT iteration, count(*) FILTER (WHERE state = 'carried') AS c FROM segments GROUP BY 1"
    per = query(storage, "s", sql)
    rows = iteration_rows(storage, "s")
    assert [r["responses_carried"] for r in rows] == per.sort_values("iteration").c.tolist()
    assert main(["--storage", storage.url, "timeline", "--run", "s"]) == 0
    out = capsys.readouterr().out
    assert "carried" in out and "finished" in out and "released" in out


def test_two_runs_commit_the_same_bytes_and_segments_change_nothing_unset(tmp_path):
    """The rows each learn takes depend on the config and the seed alone: two runs commit the same files."""
    runs = []
    for name in ("a", "b"):
        storage = open_storage((tmp_path / name).as_uri())
        init_run(storage, "s", load_config(None, SEGMENTED))
        cold()
        for k in range(3):
            run_iteration(storage, "s", k)
        runs.append(committed_files(storage, "s", 3))
    assert runs[0] == runs[1]
    assert any(f == "carried.parquet" for f, _ in runs[0][1, "rollouts"])


def test_segment_tokens_is_checked_and_left_out_of_identities_unset():
    assert "segment_tokens" not in section(load_config(None), "rollout")
    assert section(load_config(None, ["rollout.segment_tokens=64"]), "rollout")["segment_tokens"] == 64
    for bad, said in [
        (["rollout.segment_tokens=0"], "rollout.segment_tokens must be >= 1"),
        (["rollout.segment_tokens=4", "rollout.stop=[x]"], "rollout.segment_tokens with rollout.stop"),
        (["rollout.segment_tokens=4", "rollout.min_signal_groups=8"], "with rollout.min_signal_groups"),
        (["rollout.segment_tokens=4", "rollout.shards=2", "rollout.chunk_prompts=8"], "with rollout.shards"),
    ]:
        with pytest.raises(ConfigError, match=said):
            load_config(None, bad)


def test_a_run_killed_with_responses_carried_resumes_to_the_same_bytes(tmp_path):
    """SIGKILL in iteration 2's rollouts, one sampler call into its round, the responses iteration 1 carried being
    continued: resumed in a new process, every file of iterations 0-2 has the bytes of a run never stopped."""
    whole, killed = (open_storage((tmp_path / name).as_uri()) for name in ("whole", "killed"))
    extra = ["rollout.chunk_prompts=4"]  # a round of several sampler calls: the kill lands inside one
    for storage in (whole, killed):
        init_run(storage, "s", load_config(None, SEGMENTED + extra))
    cold()
    for k in range(3):
        run_iteration(whole, "s", k)
    kill_iterations_at("segments:2", killed.url, "s", 3, tmp_path)
    attempts = stage_dir(killed, "s", 2, "rollouts")
    assert list_attempts(killed, attempts) and not committed_attempts(killed, attempts)
    assert table(killed, "s", 1, "carried").finish_reason.isna().sum() > 0  # it was carrying unfinished responses
    cold()
    run_iteration(killed, "s", 2)
    assert committed_files(killed, "s", 3) == committed_files(whole, "s", 3)


def test_a_fork_continues_its_parents_carried_responses_and_a_rescore_scores_the_released_ones(segmented, tmp_path):
    """Forked at 2 with another learning rate: learn 2 runs on the parent's rollouts (by reference, carried table
    and all), and the fork's rollouts 3 continue the parent's carried responses from exactly their ids, with the
    fork's policy. A rescore of 0..1 scores each iteration's released rows, as committed."""
    storage, _ = segmented
    fork = ["fork", "--from", "s", "--at", "2", "--run", "f", "--set", "learn.lr=3e-3"]
    assert main(["--storage", storage.url, *fork]) == 0
    cold()
    mp = pytest.MonkeyPatch()
    spy = Spy(mp)
    spy.iteration = 3
    try:
        run_iteration(storage, "f", 2)
        assert committed(storage, "f", 2, "rollouts").manifest.origin is not None  # the parent's, by reference
        run_iteration(storage, "f", 3)
    finally:
        mp.undo()
    parent_carried = table(storage, "s", 2, "carried")
    mine = table(storage, "f", 3, "segments").set_index(["prompt_id", "sample_index"])
    for row in parent_carried[parent_carried.finish_reason.isna()].itertuples():
        context = tuple(list(row.prompt_ids) + list(row.response_ids))
        assert spy.calls[3].get(context), "the fork did not continue a carried response from its ids"
        assert mine.loc[(row.prompt_id, row.sample_index)].tokens_before == len(row.response_ids)
    assert table(storage, "f", 3, "rollouts").token_versions.map(lambda v: 2 in list(v)).any()  # the fork's learn 2
    assert main(["--storage", storage.url, "rescore", "--run", "s", "--iterations", "0:1", "--set",
                 "reward.truncated_reward=-1", "--as", "r"]) == 0  # fmt: skip
    for k in range(2):
        scored = pd.read_parquet(storage.uri(committed(storage, "r", k, "rewards").path("rewards.parquet")))
        rows = table(storage, "s", k, "rollouts")
        assert sorted(zip(scored.prompt_id, scored.sample_index)) == sorted(zip(rows.prompt_id, rows.sample_index))
        assert (scored.reward[rows.finish_reason.eq("length").to_numpy()] == -1).all()
