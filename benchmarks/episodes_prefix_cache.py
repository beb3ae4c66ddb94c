"""vLLM's prefix cache on multi-turn episodes (grpo/episodes), on this machine: the rollouts stage's sampler seconds
with rollout.vllm.enable_prefix_caching off and on.

    .venv/bin/python benchmarks/episodes_prefix_cache.py [--hidden 64 --layers 2] [--prompts 16] [--group-size 8]
        [--repeats 3] [--work DIR]

Why it could help: an episode samples one turn per sampler call, and each call's context is the prompt (Qwen2.5's
tool template: ~230 tokens of system message and tool schema), the turns so far and their observations; the G
episodes of a prompt share its prompt, and turn t + 1's context starts with turn t's. Without the cache every call
prefills its whole context again. The world is tests/tool_world.py's (a Qwen2 model with Qwen2.5's tool template,
warm-started on calculator transcripts so that it calls the tool), at `--hidden`/`--layers`. Each setting runs in a
process of its own (vLLM on a CPU pins torch's threads in its process): one rollouts stage to start the engine, then
`--repeats` forced reruns timed (generate_s of the manifest: the sampler and the environments), off and on taking
turns. Prints the seconds of each run and whether the two settings committed the same rows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

RUN = """
import json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from tool_world import config
from grpo.config import load_config
from grpo.record.storage import open_storage
from stages.init import init_run
from stages.rollouts import rollouts
from stages.snapshot import snapshot
root, store, caching, prompts, group, repeats = sys.argv[2:8]
storage = open_storage(store)
batch = int(prompts) * int(group)
overrides = config(Path(root), "rollout.backend=vllm", f"rollout.vllm.enable_prefix_caching={caching}",
                   f"rollout.prompts_per_iteration={prompts}", f"rollout.group_size={group}",
                   f"learn.minibatch_size={batch}", f"learn.microbatch_size={batch}")
init_run(storage, "r", load_config(None, overrides))
snapshot(storage, "r", 0)
first = rollouts(storage, "r", 0)  # starts the engine
files = sorted((f.path, f.sha256) for f in first.manifest.files)
out = {"seconds": [], "files": files, "summary": first.manifest.summary}
for _ in range(int(repeats)):
    out["seconds"].append(rollouts(storage, "r", 0, force=True).manifest.summary["generate_s"])
print("RESULT " + json.dumps(out))
"""


def run(root: Path, store: Path, caching: bool, args) -> dict:
    argv = [str(REPO / "tests"), str(root), store.as_uri(), str(caching).lower(), str(args.prompts)]
    argv += [str(args.group_size), str(args.repeats)]
    proc = subprocess.run([sys.executable, "-c", RUN, *argv], cwd=REPO, capture_output=True, text=True)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"the run failed:\n{proc.stderr[-3000:]}")
    return json.loads(line.removeprefix("RESULT "))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--work", help="a folder for the world (kept: built again only when missing)")
    args = p.parse_args()
    sys.path.insert(0, str(REPO / "tests"))
    import tool_world

    work = Path(args.work or tempfile.mkdtemp(prefix="prefix-cache-"))
    root = work / f"world-{args.hidden}x{args.layers}"
    if not (root / "world.json").exists():
        root.mkdir(parents=True, exist_ok=True)
        tool_world.world(root, hidden_size=args.hidden, num_layers=args.layers)
    results = {False: [], True: []}
    for r in range(2):  # off, on, off, on: each a process of its own
        for caching in (False, True):
            results[caching].append(run(root, work / f"store-{caching}-{r}", caching, args))
    for caching, runs in results.items():
        seconds = [s for out in runs for s in out["seconds"]]
        summary = runs[0]["summary"]
        print(
            f"enable_prefix_caching={caching}: generate_s median {statistics.median(seconds):.2f} "
            f"(runs {', '.join(f'{s:.2f}' for s in seconds)}); {summary['samples']} episodes, "
            f"{summary['turns_per_episode']:.2f} turns each, {summary['response_tokens']} response tokens"
        )
    same = results[False][0]["files"] == results[True][0]["files"]
    print(f"the same rows with and without the cache: {same}")


if __name__ == "__main__":
    main()
