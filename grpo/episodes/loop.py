"""The episode loop: the G episodes of each prompt of a chunk, sampled a turn at a time for every live one at once.

    reset every episode (its group's seed: one start for the G episodes of a prompt); render each prompt with its
        tools and what reset added
    while episodes are live:
        sample one assistant turn for each (one sampler call, each episode's context its prompt's ids and its
        response's ids so far, its random numbers seeded by the episode and the turn alone)
        parse each turn's tool calls; each environment answers its turn (the workers, in parallel)
        an episode ends when the environment says so (a tools adapter: a turn without a call), its turn was cut off
        by its token budget, it sampled rollout.max_turns turns, or its observation does not fit the budget; else the
        observation's ids, rendered as the chat template renders the messages (chat.py), are appended
    each environment's final state, then it closes

Token in, token out: what an episode's row holds is exactly what the sampler was given and gave, in order (records.py).
Deterministic: which rows a chunk commits depends on the committed inputs and the seeds alone: each turn's random
numbers come from (the stage's seed, the prompt, the sample, the turn), each environment call's from the run's seed,
the episode and the turn, whatever else shares a sampler call or a worker; so a rerun or a resumed run commits the same
bytes (given the same sampler numerics, as single-turn rollouts).

Without an environment (single-turn rollouts: no workers) an episode is one sampled run of tokens: `run` is the
sampler's one call for a chunk's prompts (spec.n samples of each, drawn from spec.seed as single-turn rollouts always
were), and `advance` continues each response from exactly its ids, seeded by the response alone; nothing is reset,
answered or replayed.

Partial rollouts (rollout.segment_tokens B: stages/segments.py) run the loop's parts apart: `open` resets new
episodes, `reopen` re-creates the environments of episodes an earlier stage carried (replay: reset with its seed, each
answered turn asked again with its seed, every answer checked against the one recorded), `advance` goes on with each
until it ends or has sampled B tokens (a turn cut there stays open, its ids continued by the next call), `close`
takes each ended one's final state and closes every other environment.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

from grpo.episodes.chat import observation_tokens, prompt_tokens, with_reset
from grpo.episodes.environment import EnvironmentFailure
from grpo.episodes.parsing import parse_turn
from grpo.episodes.records import Episode, Turn, end_of
from grpo.episodes.workers import Item, Outcome, Workers
from grpo.record.layout import episode_seed
from grpo.sampling.base import Generator, SamplingSpec


@dataclass(frozen=True)
class Start:
    """Where the G episodes of one prompt start: its id, chat messages and dataset row (what reset gets); the prompt
    as rendered without an environment (text, ids and token budget: with one, reset's answer is rendered in), the
    answer and other columns its rows record, and the iteration it was drawn in."""

    prompt_id: int
    messages: list[dict]
    row: dict
    text: str = ""
    ids: list[int] = field(default_factory=list)
    budget: int = 0
    ground_truth: str = ""
    row_json: str = "{}"
    started: int = 0


@dataclass(frozen=True)
class Limits:
    """What bounds an episode: its sampled turns, its tokens after the prompt, the model's context, a tool call's
    seconds."""

    max_turns: int
    max_tokens: int
    context: int
    tool_timeout_s: float


class Loop:
    """One stage's episodes: the sampler, the tokenizer and its end-of-turn ids, the workers (None: no environment,
    single-turn), the tools, the limits, and the policy (version, content hash) every appended token is stamped with."""

    def __init__(self, gen: Generator, tokenizer, eos_ids: tuple[int, ...], workers: Workers | None, limits: Limits,
                 policy: tuple[int, str] = (-1, "")):  # fmt: skip
        self.gen, self.tokenizer, self.eos_ids, self.workers, self.limits = gen, tokenizer, eos_ids, workers, limits
        self.policy = policy
        self.turn_ends = [tokenizer.decode([i], skip_special_tokens=False) for i in eos_ids]
        self.parse_prefix = getattr(tokenizer, "response_template", None) is not None
        self.name = "" if workers is None else workers.source.environment or ", ".join(workers.source.tools)
        self.tools: list[dict] = []  # the tools' schemas, once episodes are open
        # a token's text is at most this many bytes (the vocabulary's longest entry): an observation longer than the
        # budget's tokens times it cannot fit, and is never rendered or tokenized (an unknown-word token aside)
        self.token_bytes = max(len(t.encode()) for t in tokenizer.get_vocab())
        self.cut = 0  # observations cut: past rollout.max_observation_bytes in their worker, or past the budget
        self.rerun = 0  # episodes lost with a worker another's call killed, re-created on a fresh worker by replay

    def run(
        self, starts: list[Start], spec: SamplingSpec, env_seed: int, progress: Callable[[int], None] | None = None
    ) -> list[list[Episode]]:
        """The spec.n episodes of each start, grouped by start; spec.seed seeds the sampler, env_seed the
        environments; progress(k): the first k starts' episodes have all ended (in no particular order: a count)."""
        groups = self.open(starts, spec.n, env_seed)
        episodes = [e for group in groups for e in group]
        if self.workers is None:  # one sampler call: spec.n samples of each prompt
            out = self.gen.generate([s.ids for s in starts], spec, [s.budget for s in starts], progress)
            for e, s in zip(episodes, [s for samples in out for s in samples], strict=True):
                e.append(list(s.response_ids), True, list(s.logprobs), self.policy)
                e.end = end_of(s.finish_reason)
            return groups
        one = dataclasses.replace(spec, n=1)
        live = list(episodes)
        while live:
            live = self._answer(self._sample(live, one))
            if progress is not None:
                ended = {e.prompt_id for e in live}
                progress(sum(s.prompt_id not in ended for s in starts))
        self.finish(episodes)
        return groups

    def open(self, starts: list[Start], g: int, env_seed: int) -> list[list[Episode]]:
        """g new episodes of each start, reset (their environments seeded by env_seed), grouped by start."""
        keys = iter(self.workers.keys(len(starts) * g)) if self.workers is not None else iter([None] * len(starts) * g)
        episodes = [
            Episode(s.prompt_id, j, next(keys), s.text, s.ids, budget=s.budget, env_seed=env_seed,
                    ground_truth=s.ground_truth, row_json=s.row_json, started=s.started)
            for s in starts for j in range(g)
        ]  # fmt: skip
        if self.workers is not None:
            self.tools = self._reset(starts, episodes, g, env_seed)
        return [episodes[i * g : (i + 1) * g] for i in range(len(starts))]

    def advance(self, live: list[Episode], spec: SamplingSpec, cap: int, rows: int, progress=None) -> int:
        """Go on with each episode of `live` until it ends or has sampled `cap` tokens in this call (rollout.
        segment_tokens: a turn cut there stays open, to be continued from its ids; one that ends on the cap is
        answered), `rows` episodes at a time (a sampler call each turn); returns the tokens sampled. progress(k) as
        the first k episodes' first sampler calls end."""
        one, before = dataclasses.replace(spec, n=1), {id(e): len(e.response_ids) for e in live}

        def sampled(e: Episode) -> int:
            return sum(e.loss_mask[before[id(e)] :])

        for at in range(0, len(live), rows):
            going = [e for e in live[at : at + rows] if e.end is None]
            done = None if progress is None else (lambda k, at=at: progress(at + k))
            while going:
                ended = self._sample(going, one, [cap - sampled(e) for e in going], done)
                going, done = [e for e in self._answer(ended) if sampled(e) < cap], None
        return sum(map(sampled, live))

    def close(self, episodes: list[Episode]) -> None:
        """The final state of each episode of `episodes` that ended (its environment then closes); every other's
        environment closed as it is (a carried episode's is re-created by the next stage: reopen)."""
        if self.workers is not None:
            self.finish([e for e in episodes if e.end is not None])
            self.workers.run("close", [Item(e.key, 0) for e in episodes if e.end is None])

    def reopen(self, episodes: list[Episode], pending: bool = False) -> None:
        """Re-create the environments of episodes carried from an earlier stage (rollout.segment_tokens): each reset
        with its group's seed, then asked each turn it answered, with that turn's seed, again (`pending`: all but the
        last, which awaits its answer). An answer other than
        the one recorded fails the stage in one line: that environment does not answer alike given its seeds (it
        has effects outside it, or draws from a generator it does not seed), so it cannot go on in another process."""
        if self.workers is None:
            return
        for e, key in zip(episodes, self.workers.keys(len(episodes))):
            e.key = key
        outcomes = self.workers.run("replay", [self._replay_item(e, len(e.turns) - pending) for e in episodes])
        for e, o in zip(episodes, outcomes):
            self._check(e, o, "replay")
            added, self.tools, replies = o.value
            answers = [(False, t.reply, t.errors) for t in e.turns[: len(e.turns) - pending]]
            for k, (got, recorded) in enumerate(zip([(added, None, [])] + replies, [(e.added, None, [])] + answers)):
                if got != recorded:
                    where = "reset" if k == 0 else f"turn {k - 1}"
                    raise EnvironmentFailure(
                        f"environment {self.name}: replayed to continue the episode prompt_id {e.prompt_id} sample "
                        f"{e.sample_index}, it answered {where} otherwise than recorded ({got!r:.120} against "
                        f"{recorded!r:.120}); an environment must answer alike given its seeds to be carried across "
                        "iterations: seed it from reset's seed, or unset rollout.segment_tokens"
                    )

    def _replay_item(self, e: Episode, answered: int) -> Item:
        turns = [(t.text, t.calls, episode_seed(e.env_seed, e.prompt_id, e.sample_index, k + 1)) for k, t in
                 enumerate(e.turns[:answered])]  # fmt: skip
        limit = self.limits.tool_timeout_s * (1 + sum(len(t.calls) + 1 for t in e.turns))  # the reset, each call
        seed = episode_seed(e.env_seed, e.prompt_id, 0, 0)
        return Item(e.key, seed, (e.row, seed, turns), limit)

    def _answer(self, ended: list[Episode]) -> list[Episode]:
        """The environments' answers to the turns that ended; the episodes that go on (none without an environment:
        its one turn was its response)."""
        if self.workers is None:
            return []
        outcomes = self.workers.run("respond", [self._respond_item(e) for e in ended])
        again = [i for i, o in enumerate(outcomes) if o.bystander]
        if again:  # lost with a worker another episode's call killed: re-created on a fresh worker, asked again
            try:
                self.reopen([ended[i] for i in again], pending=True)
            except EnvironmentFailure:  # an environment that cannot be replayed alike: those stay lost
                return [e for e, o in zip(ended, outcomes) if self._answered(e, o)]
            self.rerun += len(again)
            for i, o in zip(again, self.workers.run("respond", [self._respond_item(ended[i]) for i in again])):
                outcomes[i] = o
        return [e for e, o in zip(ended, outcomes) if self._answered(e, o)]

    def _reset(self, starts: list[Start], episodes: list[Episode], g: int, env_seed: int) -> list[dict]:
        """Reset every episode (a group's with one seed), render each prompt with its tools and what reset added;
        the tools' schemas."""
        seeds = [episode_seed(env_seed, s.prompt_id, 0, 0) for s in starts]
        limit = self.limits.tool_timeout_s  # a reset (constructing the episode's instance) is bounded as a call
        items = [Item(e.key, seeds[i // g], (starts[i // g].row, seeds[i // g]), limit) for i, e in enumerate(episodes)]
        outcomes = self.workers.run("reset", items)
        for e, o in zip(episodes, outcomes):
            self._check(e, o, "reset")
        self.cut += sum(o.value[2] > 0 for o in outcomes)
        tools = outcomes[0].value[1] if outcomes else self.tools
        for i, s in enumerate(starts):
            group = [o.value[0] for o in outcomes[i * g : (i + 1) * g]]
            if any(added != group[0] for added in group):
                raise EnvironmentFailure(
                    f"environment {self.name}: reset gave the {g} episodes of prompt_id {s.prompt_id} different starts "
                    "with one seed; a group's episodes must start alike (seed the environment from reset's seed)"
                )
            messages = with_reset(s.messages, group[0])
            text, ids = prompt_tokens(self.tokenizer, messages, tools)
            budget = min(self.limits.max_tokens, self.limits.context - len(ids))
            if budget < 1:
                raise EnvironmentFailure(
                    f"prompt_id {s.prompt_id} with the environment's reset is {len(ids)} tokens, leaving none of the "
                    f"model's {self.limits.context} positions to respond in; raise the context or shorten the prompt"
                )
            for e in episodes[i * g : (i + 1) * g]:
                e.prompt_text, e.prompt_ids, e.messages, e.prompt_messages = text, ids, list(messages), len(messages)
                e.budget, e.row, e.added = budget, s.row, group[0]
        return tools

    def _sample(
        self, live: list[Episode], spec: SamplingSpec, caps: list[int] | None = None, progress=None
    ) -> list[Episode]:
        """One turn of every live episode, appended with mask 1 and parsed; with `caps`, at most caps[i] tokens of it
        (a turn cut there stays open: its next call continues it). Returns the episodes whose turn ended (without an
        environment: none, each that ended has ended as an episode)."""
        contexts = [e.prompt_ids + e.response_ids for e in live]
        room = [e.budget - len(e.response_ids) for e in live]
        budgets = room if caps is None else [min(c, r) for c, r in zip(caps, room)]
        seeds = [episode_seed(spec.seed, e.prompt_id, e.sample_index, len(e.turns)) for e in live]
        samples = self.gen.generate(contexts, spec, budgets, progress, seeds=seeds)
        ended = []
        for e, left, [s] in zip(live, room, samples):
            start = len(e.response_ids) if e.open is None else e.open
            e.append(list(s.response_ids), True, list(s.logprobs), self.policy)
            if caps is not None and s.finish_reason == "length" and len(s.response_ids) < left:
                e.open = start if e.has_environment else None  # cut by the cap, not the budget
                continue
            if not e.has_environment:
                e.end = end_of(s.finish_reason)
                continue
            e.open, sampled = None, e.response_ids[start:]
            ids = sampled[:-1] if sampled and sampled[-1] in self.eos_ids else sampled
            text = self.tokenizer.decode(ids, skip_special_tokens=False)
            context = e.prompt_ids + e.response_ids[:start]
            prefix = self.tokenizer.decode(context, skip_special_tokens=False) if self.parse_prefix else ""
            message, calls = parse_turn(self.tokenizer, text, prefix, self.tools)
            e.messages.append(message)
            e.turns.append(Turn(start, len(e.response_ids), text, s.finish_reason, calls))
            ended.append(e)
        return ended

    def _respond_item(self, e: Episode) -> Item:
        t, turn = e.turns[-1], len(e.turns) - 1
        limit = self.limits.tool_timeout_s * (len(t.calls) + 1)  # each call's own alarm comes first
        return Item(e.key, episode_seed(e.env_seed, e.prompt_id, e.sample_index, turn + 1), (t.text, t.calls), limit)

    def _answered(self, e: Episode, o: Outcome) -> bool:
        """Record the environment's answer to the episode's last turn; True when the episode goes on (its
        observation's ids appended)."""
        t = e.turns[-1]
        t.tool_s = o.seconds
        if o.lost is not None:
            t.errors, e.end = [o.lost], "lost"
            return False
        self._check(e, o, f"turn {len(e.turns) - 1}")
        reply = o.value
        t.errors = list(reply.errors)
        t.observation = "\n".join(str(m["content"]) for m in reply.messages) if reply.messages else None
        t.reply = list(reply.messages)
        room = (e.budget - len(e.response_ids)) * self.token_bytes  # the most text the budget's tokens can hold
        over = False
        if t.finish == "length":
            e.end = "budget"
        elif reply.done or not reply.messages:
            e.end = "done"
        elif len(e.turns) >= self.limits.max_turns:
            e.end = "max_turns"
        elif over := sum(_text_bytes(m["content"]) for m in reply.messages) > room:
            e.end = "budget"  # cut to nothing: never rendered or tokenized (a tool's 40 MB answer)
        else:
            sampled = e.response_ids[t.start : t.end]
            ended = self.tokenizer.decode(sampled[-1:], skip_special_tokens=False) if sampled else None
            ended = ended if sampled and sampled[-1] in self.eos_ids else None
            _, ids = observation_tokens(self.tokenizer, e.messages, reply.messages, self.tools, ended, self.turn_ends)
            if len(e.response_ids) + len(ids) >= e.budget:  # no room left for the observation and a token after it
                e.end = "budget"
            else:
                e.append(ids, False, None, self.policy)
                e.messages += reply.messages
                t.appended = len(ids)
        self.cut += bool(reply.cut) or over
        return e.end is None

    def finish(self, episodes: list[Episode]) -> None:
        """Each environment's final state (then it closes)."""
        last = self.limits.max_turns + 1
        items = [Item(e.key, episode_seed(e.env_seed, e.prompt_id, e.sample_index, last)) for e in episodes]
        limit = 2 * self.limits.tool_timeout_s
        items = [dataclasses.replace(item, limit_s=limit) for item in items]
        for e, o in zip(episodes, self.workers.run("final", items)):
            if o.lost is None:
                self._check(e, o, "final")
                e.final = o.value

    def _check(self, e: Episode, o: Outcome, where: str) -> None:
        """A failed (or, in reset, lost) environment call fails the stage in one line naming it."""
        why = o.failed or (o.lost if where in ("reset", "replay") else None)
        if why is not None:
            raise EnvironmentFailure(
                f"environment {self.name} failed in {where} of the episode prompt_id {e.prompt_id} sample "
                f"{e.sample_index}: {why}"
            )


def _text_bytes(content) -> int:
    """UTF-8 bytes of a message content's text (a string, or content blocks)."""
    if isinstance(content, str):
        return len(content.encode("utf-8", "replace"))
    if isinstance(content, list):
        return sum(map(_text_bytes, content))
    return sum(map(_text_bytes, content.values())) if isinstance(content, dict) else len(str(content))
