"""`grpo export`: a run's committed policy (the newest, the best, or iteration k's) as a self-contained Hugging
Face folder, written by default under the run's folder."""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
from pathlib import Path

from flows.commands.card import model_card
from flows.commands.hub import hub_repo, push_folder
from grpo.record.checkpoint import WEIGHT_SUFFIXES, checkpoint_dtype, policy_folders, tokenizer_and_config
from grpo.record.counts import is_local
from grpo.record.layout import export_dir, stage_dir
from grpo.record.lineage import newest_current_learn, newest_learn
from grpo.record.storage import Committed, Storage, committed_attempts, url_to_fs
from grpo.record.weights import load_model, model_class
from grpo.report import best_iteration
from stages import StageError


def cmd_export(args, storage):
    from grpo.record.lineage import committed_input
    from stages.common import load_run

    cfg = load_run(storage, args.run)
    if args.dir is not None and args.out is not None:
        raise StageError("export: name the folder to write once: `grpo export --run R DIR` or `--out DIR`")
    pushed = hub_repo(args.push_to_hub) if args.push_to_hub else None  # (OWNER/NAME, token), or one line now
    which = ""
    k = newest_policy_to_export(storage, args.run) if args.iteration is None and not args.best else args.iteration
    asked = args.iteration is not None or args.best
    warm = args.sft or (not asked and k < 0 and cfg.sft is not None)  # before any learn: the warm start is newest
    if args.best:
        best = best_iteration(storage, args.run)
        if best is None:
            raise StageError(f"run {args.run}: no eval has run yet, so none is best; export --latest or --iteration K")
        if best.all_zero:
            raise StageError(
                f"run {args.run}: every eval so far scored {best.metric} 0, so none is best; "
                "export --latest or --iteration K"
            )
        k, which = best.iteration, f" (the best: {best.metric} {best.value:.4g})"
        if (stale := newest_current_learn(storage, args.run)[1]) is not None and k >= stale:
            raise StageError(
                f"export --best: run {args.run}'s best, iteration {k}, is stale (learn {stale} was made from inputs a "
                f"newer attempt replaced); rebuild with `grpo run --run {args.run} --start {stale}`, or export it as "
                f"it is with `--iteration {k}`"
            )
    if warm:
        k = -1
    if args.adapter and (cfg.learn.lora is None or (k < 0 and not warm)):
        why = "its learner trains whole weights (learn.lora is null)" if cfg.learn.lora is None else "no learn yet"
        raise StageError(f"--adapter: run {args.run} has no LoRA adapter to export: {why}; export without --adapter")
    base = committed_input(storage, args.run, None, "base")
    policy = (
        warm_start_source(storage, cfg, args.run) if warm else base if k < 0 else export_source(storage, args.run, k)
    )
    at = None if k < 0 else k
    out = args.dir or args.out or default_export(storage, args.run, at, adapter=args.adapter, warm_start=warm)
    named = "the warm start (grpo sft)" if warm else "the base model" if k < 0 else f"the policy of iteration {k}"
    what = f"{named} of run {args.run}{which}" + (", its LoRA adapter unmerged" if args.adapter else "")
    source = {"run_id": args.run, "iteration": at, **dataclasses.asdict(policy.ref())}
    source |= ({"adapter": True} if args.adapter else {}) | ({"sft": True} if warm else {})
    fs, root = url_to_fs(out)
    try:
        if args.adapter:
            export_adapter(policy, base, out, cfg.model.base_model)
        else:
            export_policy(policy, base, out)
    except FileExistsError as e:
        if args.dir is None and args.out is None and _exported_from(fs, root) == source:
            if pushed is None:
                print(f"{what}: exported already, {shown_path(out)}")
                return  # pushed: its card is written again below, naming the hub's repository
        else:
            raise StageError(str(e)) from e
    evaluated = policy.manifest.summary if warm else None if k < 0 else eval_summary(storage, args.run, k)
    auto = model_class(tokenizer_and_config(base)[1]).__name__  # the class that loads it whole (a vision tower too)
    loads = pushed[0] if pushed else shown_path(out)  # what the card's from_pretrained names
    card = model_card(cfg, args.run, at, policy.uri, evaluated, args.adapter, loads, auto, warm_start=warm)
    fs.pipe_file(f"{root}/README.md", card.encode())  # the model card
    fs.pipe_file(f"{root}/{EXPORT_SOURCE}", json.dumps(source, indent=1).encode())  # last: the export is whole
    print(f"{what}: {shown_path(out)}")
    if pushed:
        url = push_folder(out, *pushed, private=args.private, message=f"grpo-flow: {what}")
        print(f"{what}: pushed to {pushed[0]} ({url})")


def newest_policy_to_export(storage, run_id: str) -> int:
    """The iteration `grpo export` exports unasked: the newest committed learn; one line refusing a stale one
    (made from inputs a newer attempt replaced), naming the command that rebuilds it and the --iteration that
    exports it as it is."""
    current, stale = newest_current_learn(storage, run_id)
    if stale is None:
        return current
    newest = newest_learn(storage, run_id)
    older = f", or `--iteration {current}`, the newest current one" if current >= 0 else ""
    raise StageError(
        f"export: run {run_id}'s newest policy, iteration {newest}, is stale (learn {stale} was made from inputs a "
        f"newer attempt replaced); rebuild it with `grpo run --run {run_id} --start {stale}`, or export it as it is "
        f"with `--iteration {newest}`{older}"
    )


def warm_start_source(storage, cfg, run_id: str) -> Committed:
    """The run's committed warm start (`grpo sft`), verified; one line when its config sets none or none is
    committed."""
    from grpo.record.lineage import committed_input

    if cfg.sft is None:
        raise StageError(f"export --sft: run {run_id} has no warm start (its config sets no sft section)")
    if not committed_attempts(storage, stage_dir(storage, run_id, None, "sft")):
        raise StageError(f"export --sft: run {run_id}'s warm start is not committed; run `grpo sft --run {run_id}`")
    return committed_input(storage, run_id, None, "sft")


def eval_summary(storage, run_id: str, k: int) -> dict | None:
    """Iteration k's committed eval summary (None: none committed)."""
    from grpo.record.storage import NotCommittedError, latest_committed

    try:
        return latest_committed(storage, stage_dir(storage, run_id, k, "eval"), verify=False).manifest.summary
    except NotCommittedError:
        return None


EXPORT_SOURCE = "grpo_export.json"
"""Written into an exported folder last: the run, iteration and committed attempt it holds (so a second export to
the default folder knows it is there already)."""


def default_export(
    storage: Storage, run_id: str, k: int | None, adapter: bool = False, warm_start: bool = False
) -> str:
    """Where `grpo export` writes without a folder named (layout.export_dir, `-adapter` after it with --adapter): a
    local path, or a URL."""
    path = export_dir(storage, run_id, k, warm_start) + ("-adapter" if adapter else "")
    return path if is_local(storage.fs) else storage.uri(path)


def _exported_from(fs, root: str) -> dict | None:
    """What an exported folder's EXPORT_SOURCE says it holds (None: none, or not readable)."""
    try:
        return json.loads(fs.cat_file(f"{root}/{EXPORT_SOURCE}"))
    except (OSError, ValueError):
        return None


def shown_path(out: str) -> str:
    """A local folder relative to the working folder where under it (to paste into from_pretrained), else as is."""
    path = Path(out)
    return str(path.relative_to(Path.cwd())) if path.is_absolute() and path.is_relative_to(Path.cwd()) else out


def export_source(storage, run_id: str, k: int):
    """Iteration k's committed learn, verified; one line when it has none, its files changed after the commit
    (committed_input says so) or `grpo gc --retention` collected its policy."""
    from grpo.record.checkpoint import ADAPTER_PREFIX, CHECKPOINT_PREFIX
    from grpo.record.lineage import committed_input

    if not committed_attempts(storage, stage_dir(storage, run_id, k, "learn")):
        n = newest_learn(storage, run_id)
        newest = f"the newest committed is iteration {n}" if n >= 0 else "none is committed yet"
        raise StageError(f"run {run_id}: iteration {k} has no committed learn (its policy is not committed; {newest})")
    policy = committed_input(storage, run_id, k, "learn")
    if any(p.startswith((CHECKPOINT_PREFIX, ADAPTER_PREFIX)) for p in policy.collected):
        raise StageError(f"run {run_id}: the policy of iteration {k} was collected by `grpo gc --retention`")
    return policy


def export_adapter(policy: Committed, base: Committed, out: str, base_model: str | None) -> str:
    """Write a LoRA learn's peft adapter, unmerged, as a folder at `out` (new): adapter_config.json (its
    base_model_name_or_path the run's model.base_model where it names one) and adapter_model.safetensors, with the
    base's tokenizer and chat template beside them. Returns `out`."""
    fs, root = url_to_fs(out)
    if fs.exists(root):
        raise FileExistsError(f"{out} exists; export writes a new folder (name another, or remove it)")
    _, model_dir, adapter_dir = policy_folders(policy, base)
    with tempfile.TemporaryDirectory() as tmp:
        for f in Path(adapter_dir).iterdir():
            shutil.copyfile(f, Path(tmp, f.name))
        config = json.loads(Path(tmp, "adapter_config.json").read_text())
        config["base_model_name_or_path"] = base_model  # None for a tiny model built here: the card says so
        Path(tmp, "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        for f in Path(model_dir).iterdir():  # tokenizer, chat template (not the base's config or weights)
            if f.name not in ("config.json", "generation_config.json") and not f.name.endswith(WEIGHT_SUFFIXES):
                shutil.copyfile(f, Path(tmp, f.name))
        fs.put(tmp.rstrip("/") + "/", root, recursive=True)
    return out


def export_policy(policy: Committed, base: Committed | None, out: str) -> str:
    """Write the committed `policy` (a learn or the base) as a self-contained HF folder at `out` (a local
    folder or an fsspec URL; it must not exist yet): a LoRA learn's adapters merged into `base`'s weights
    (in the base's dtype), the tokenizer, chat template and generation config beside them. Returns `out`."""
    fs, root = url_to_fs(out)
    if fs.exists(root):
        raise FileExistsError(f"{out} exists; export writes a new folder (name another, or remove it)")
    holder, model_dir, adapter_dir = policy_folders(policy, base)
    with tempfile.TemporaryDirectory() as tmp:
        if adapter_dir is None:
            for f in Path(model_dir).iterdir():
                shutil.copyfile(f, Path(tmp, f.name))  # the cache holds symlinks on local storage: real files
        else:
            from peft import PeftModel

            lm = load_model(model_dir, checkpoint_dtype(model_dir))  # its own architecture: a vision tower kept
            merged = PeftModel.from_pretrained(lm, adapter_dir).merge_and_unload()
            merged.save_pretrained(tmp, safe_serialization=True)
            written = {p.name for p in Path(tmp).iterdir()}
            for f in Path(model_dir).iterdir():  # tokenizer, chat template, generation config
                if f.name not in written and not f.name.endswith(WEIGHT_SUFFIXES):
                    shutil.copyfile(f, Path(tmp, f.name))
        fs.put(tmp.rstrip("/") + "/", root, recursive=True)
    return out
