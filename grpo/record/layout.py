"""Where a run lives in storage, the order of its stages, and the seeds they draw from.

    <storage>/runs/<run_id>/run.json                 resolved config, written once
    <storage>/runs/<run_id>/base/attempt-*/          the base (and reference) model
    <storage>/runs/<run_id>/iter-000k/<stage>/attempt-*/
    <storage>/runs/<run_id>/iter-000k/state/attempt-*/     learn k's resume state, committed after its policy
    <storage>/runs/<run_id>/exports/iter-000k/       `grpo export` without a folder: an HF folder of a policy

Every path of a run is built here; the stages, the CLI, `grpo query` and the flow import it.
"""

from __future__ import annotations

import enum
import hashlib
import re
import unicodedata
from typing import TYPE_CHECKING, Literal, get_args

from grpo.errors import LayoutError

if TYPE_CHECKING:  # the CLI reads STAGES before it knows whether its command needs storage
    from grpo.record.storage import Storage

StageName = Literal["snapshot", "rollouts", "rewards", "advantages", "learn", "eval"]
STAGES: tuple[str, ...] = get_args(StageName)  # the order an iteration runs them in
STATE_STAGE = "state"
"""Learn k's resume state (STATE_PREFIXES), committed apart after its policy (grpo/record/resume.py): no stage of the
iteration's order, only the next learn built from files reads it."""
OptionalStageName = Literal["teacher"]
OPTIONAL_STAGES = {"teacher": "advantages"}
"""Stages an iteration runs only when the run's config section of their name is set, {stage: the stage it runs
before} (its keys: OptionalStageName's, which the flow's force_stage and placement accept beside StageName's):
`teacher` (on-policy distillation, stages/teacher.py) scores the rollouts before the advantages read them. A run
without the section runs and commits exactly STAGES."""


def stages_of(cfg) -> tuple[str, ...]:
    """The stages an iteration of a run with config `cfg` runs, in order: STAGES with each optional stage whose
    section is set (OPTIONAL_STAGES).

    >>> from types import SimpleNamespace as S
    >>> stages_of(S(teacher=None)) == STAGES, stages_of(S(teacher=object()))[2:5]
    (True, ('rewards', 'teacher', 'advantages'))
    """
    out: list[str] = []
    for s in STAGES:
        out += [o for o, before in OPTIONAL_STAGES.items() if before == s and getattr(cfg, o, None) is not None]
        out.append(s)
    return tuple(out)


def run_dir(storage: Storage, run_id: str) -> str:
    """The run's folder; a run id that is no plain name is refused in one line."""
    shown = f"{run_id[:40]!r}{'...' if len(run_id) > 40 else ''}"  # repr: U+202E and the like as escapes
    if not run_id or "/" in run_id or run_id.startswith(".") or len(run_id) > 128:
        raise LayoutError(f"run id {shown} must be a name of 1-128 characters without '/', not starting with '.'")
    at = next((i for i, c in enumerate(run_id) if unicodedata.category(c) in _INVISIBLE), None)
    if at is not None:  # a bidi override shows a name other than the one stored; a newline splits a line
        c = run_id[at]
        raise LayoutError(
            f"run id {shown} must be a name without control or format characters; it holds "
            f"U+{ord(c):04X} ({unicodedata.name(c, 'a control character')}) at position {at}"
        )
    return storage.path("runs", run_id)


# control (Cc), format (Cf: bidi overrides and isolates, zero-width), surrogate (Cs), line and paragraph separators
_INVISIBLE = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})


def run_json(storage: Storage, run_id: str) -> str:
    """The run's resolved config, written once by `grpo init`."""
    return f"{run_dir(storage, run_id)}/run.json"


def run_ids(storage: Storage) -> list[str]:
    """The runs in storage: the folders under runs/ that hold a run.json."""
    try:
        folders = storage.fs.ls(storage.path("runs"), detail=False)
    except FileNotFoundError:
        return []
    names = sorted(f.rstrip("/").rsplit("/", 1)[-1] for f in folders)
    return [n for n in names if storage.exists(run_json(storage, n))]


def forking_json(storage: Storage, run_id: str) -> str:
    """A fork being made (grpo.record.fork): its parent and fork point, written before the first attempt it takes
    by reference and removed once its run.json is written, so that a fork killed in between is seen (a half-made
    fork: `grpo fork` again finishes it, `grpo delete` removes it, the parent's gc keeps what it references)."""
    return f"{run_dir(storage, run_id)}/forking.json"


def half_made_forks(storage: Storage) -> list[str]:
    """The run folders under runs/ holding a forking.json and no run.json."""
    try:
        folders = storage.fs.ls(storage.path("runs"), detail=False)
    except FileNotFoundError:
        return []
    names = sorted(f.rstrip("/").rsplit("/", 1)[-1] for f in folders)
    return [n for n in names if storage.exists(forking_json(storage, n)) and not storage.exists(run_json(storage, n))]


def no_such_run(storage: Storage, run_id: str) -> str:
    """The one line for a run id that storage does not hold: which runs it does hold."""
    runs = run_ids(storage)
    here = f"the runs here are {', '.join(runs)}" if runs else "there are no runs here yet"
    return f"{storage.uri(run_dir(storage, run_id))}: no such run ({here}); create it with `grpo init --run {run_id}`"


def stage_dir(storage: Storage, run_id: str, iteration: int | None, stage: str) -> str:
    """Folder of a stage's attempts: per iteration, or run-wide (iteration None: `base`)."""
    if iteration is None:
        return f"{run_dir(storage, run_id)}/{stage}"
    if iteration < 0:
        raise LayoutError(f"iteration must be >= 0, got {iteration}")
    return f"{run_dir(storage, run_id)}/iter-{iteration:04d}/{stage}"


def export_dir(storage: Storage, run_id: str, iteration: int | None, warm_start: bool = False) -> str:
    """Where `grpo export` writes a policy when given no folder: exports/iter-000k in the run's folder (None: the
    base model, exports/base; `warm_start`: the warm start's, exports/sft), beside what made it, as TRL's output_dir
    holds its trainer's final model; outside every stage folder, so gc, status and query never read it."""
    name = "sft" if warm_start else "base" if iteration is None else f"iter-{iteration:04d}"
    return f"{run_dir(storage, run_id)}/exports/{name}"


SHARDED = ("rollouts", "rewards")
"""The stages that split their work into shards (rollout.shards, reward.shards: stages.shards)."""


def shard_stage(stage: str, shard: int, shards: int) -> str:
    """The stage name (and folder, beside the stage's own) of shard `shard` of `shards` of a sharded stage
    (rollout.shards, reward.shards): `rollouts-shard-1-of-4`."""
    return f"{stage}-shard-{shard}-of-{shards}"


SHARD_FOLDER = re.compile(r"(?P<stage>[a-z]+)-shard-(?P<shard>\d+)-of-(?P<shards>\d+)$")
"""What `shard_stage` names."""


def shard_dirs(storage: Storage, run_id: str, iteration: int) -> dict[str, list[str]]:
    """{stage: its shards' folders, shard 0 first} of an iteration's sharded stages in the order they run, every
    shard of the stage's number of shards whether tried yet or not (its folder may not exist)."""
    idir = stage_dir(storage, run_id, iteration, STAGES[0]).rsplit("/", 1)[0]
    try:
        names = [p.rstrip("/").rsplit("/", 1)[-1] for p in storage.fs.ls(idir, detail=False)]
    except FileNotFoundError:
        return {}
    counts = {m["stage"]: int(m["shards"]) for m in map(SHARD_FOLDER.match, sorted(names)) if m}
    return {s: [f"{idir}/{shard_stage(s, k, counts[s])}" for k in range(counts[s])] for s in STAGES if s in counts}


POLICY_PREFIXES = ("policy/", "adapter/", "master.safetensors")
"""A learn attempt's policy weights: the checkpoint (full fine-tuning) or the LoRA adapters, and the
float32 master copy of a narrower checkpoint."""
STATE_DCP = "dcp"  # learn.sharding=fsdp2: every process's shards of the weights and AdamW state
STATE_PREFIXES = ("optimizer.pt", "rng.pt", "master.safetensors", f"{STATE_DCP}/")
"""A learner's optimizer and resume state: AdamW, the RNG states, the master copy, and the torch Distributed
Checkpoint shards (learn.sharding=fsdp2); in a STATE_STAGE attempt, or in the learn attempt itself (runs made
before the split, learn.nodes > 1). A file is either's when its path starts with one of these."""


class Salt(enum.IntEnum):
    """What a seed is for: each purpose draws from its own stream of the run seed and iteration."""

    PROMPTS = 1  # the task generator's training prompts of an iteration
    SAMPLING = 2  # the sampler's random numbers
    LEARNER_TORCH = 3  # torch's global RNG in the learner
    LEARNER_SHUFFLE = 4  # the order of the learner's minibatches
    EPOCH_DRAWS = 5  # the permutation of each epoch over a dataset (iteration 0's seed for all)
    ENVIRONMENT = 6  # episodes' environments: a group's reset, the Python generators of each call (grpo/episodes)


def iteration_seed(run_seed: int, iteration: int, salt: Salt) -> int:
    """Distinct, reproducible seed per (run seed, iteration, purpose)."""
    return (run_seed * 1_000_003 + iteration * 7919 + int(salt)) % (2**31 - 1)


def round_seed(run_seed: int, iteration: int, round: int, salt: Salt) -> int:
    """Seed of sampling round `round` of an iteration (rollout.min_signal_groups: dynamic sampling); round 0's
    is the iteration's own, so an iteration that needs no extra round samples what it always did."""
    seed = iteration_seed(run_seed, iteration, salt)
    return seed if round == 0 else (seed * 1_000_033 + round * 104_729) % (2**31 - 1)


def episode_seed(seed: int, prompt_id: int, sample_index: int, turn: int) -> int:
    """Seed of one turn of one episode (grpo/episodes), from a stage's seed: the sampler's for turn `turn` of sample
    `sample_index` of prompt `prompt_id`, and the environment's. A hash, so it depends on these four alone (not on
    which episodes share a sampler call or a worker).

    >>> episode_seed(7, 3, 1, 0) == episode_seed(7, 3, 1, 0) != episode_seed(7, 3, 1, 1)
    True
    """
    digest = hashlib.sha256(f"{seed}:{prompt_id}:{sample_index}:{turn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") % (2**31 - 1)
