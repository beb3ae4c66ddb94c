"""`grpo config show | set`: a run's settings as its run.json holds them, and a change to those that may change
(tracking, retention, when evals run, shards, where the learner and sampler run) without repeating the rest."""

from __future__ import annotations


def cmd_config_show(args, storage):
    import yaml

    from stages.common import load_run

    print(yaml.safe_dump(load_run(storage, args.run).to_dict(), sort_keys=False), end="")


def cmd_config_set(args, storage):
    from flows.commands.hints import grpo_command
    from grpo.config import load_config
    from stages import StageError
    from stages.common import load_run
    from stages.init import write_run_json

    old = load_run(storage, args.run)
    new = load_config(old.to_dict(), args.settings)  # an unknown field or a bad value: its one line
    changed = changes(old.to_dict(), new.to_dict())
    if not changed:
        print(f"run {args.run}: nothing to change ({', '.join(args.settings)} as set already)")
        return
    try:
        write_run_json(storage, args.run, new)
    except StageError as e:  # a setting a committed result depends on
        fork = f"{grpo_command(args.storage)} fork --from {args.run} --at K --run NEW " + " ".join(
            f"--set {s}" for s in args.settings
        )
        raise StageError(f"{e}; to train on with it from iteration K: `{fork}`") from None
    print(f"run {args.run}: " + "; ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changed.items()))


def changes(old: dict, new: dict) -> dict[str, tuple]:
    """{section.field: (old, new)} of what differs between two configs' dicts.

    >>> changes({"seed": 0, "learn": {"lr": 1.0, "epochs": 2}}, {"seed": 0, "learn": {"lr": 2.0, "epochs": 2}})
    {'learn.lr': (1.0, 2.0)}
    """
    out = {}
    for section, value in new.items():
        if isinstance(value, dict):
            out |= {f"{section}.{k}": (old[section].get(k), v) for k, v in value.items() if old[section].get(k) != v}
        elif old.get(section) != value:
            out[section] = (old.get(section), value)
    return out
