"""`grpo gc | delete`: list or remove what a run no longer needs (failed and superseded attempts, weights its
retention does not keep), or a whole run no fork references."""

from __future__ import annotations


def cmd_gc(args, storage):
    from grpo.gc import held_summary, plan, remove
    from grpo.scoring.judge_cache import remove_unused
    from stages.common import load_run

    cfg = load_run(storage, args.run)
    found = plan(storage, args.run, min_age_s=args.older_than_s, retention=cfg.retention if args.retention else None)
    for g in found.garbage:
        files = sorted({f.split("/")[0] + ("/" if "/" in f else "") for f in g.files})
        what = storage.uri(g.path) + (f" [{', '.join(files)}]  ({g.note})" if g.files else "")
        print(f"{g.why:>10}  {g.bytes / 1e6:9.1f} MB  {what}")
    for u in found.judge_cache:
        what = f"{u.dropped} answer(s) no committed judge table refers to" + (f"; {len(u.kept)} kept" if u.kept else "")
        print(f"{'judge':>10}  {u.bytes / 1e6:9.1f} MB  {storage.uri(u.path)}  ({what})")
    for h in found.held:
        print(f"{'left':>10}  {'':>12}  {storage.uri(h.path)}  ({h.note})")
    for line in found.kept:
        print(f"{'keep':>10}  {'':>12}  {line}")
    if found.held:
        print(f"held back: {held_summary(found.held)}")
    total = (sum(g.bytes for g in found.garbage) + sum(u.bytes for u in found.judge_cache)) / 1e6
    items = len(found.garbage) + len(found.judge_cache)
    if args.delete:
        remove(storage, found.garbage)
        remove_unused(storage, found.judge_cache)
        print(f"removed {items} item(s), {total:.1f} MB")
    else:
        print(f"{items} item(s), {total:.1f} MB; nothing removed (dry run): add --delete to remove them")


def cmd_delete(args, storage):
    from grpo.gc import delete_run, run_files

    files, size = run_files(storage, args.run)
    if not args.yes:
        print(f"run {args.run}: {files} files, {size / 1e6:.1f} MB; nothing removed (dry run): add --yes to delete it")
        return
    delete_run(storage, args.run)
    print(f"run {args.run}: deleted ({files} files, {size / 1e6:.1f} MB); `grpo gc` of its parent may now free more")
