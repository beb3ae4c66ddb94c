"""`grpo`: create runs, run one stage or whole iterations, and inspect a run.

grpo init --run demo [--config cfg.yaml] [--set learn.lr=1e-3 ...]
grpo config set --run demo retention.keep_last=5 eval.every=2   # the rest as the run has it
grpo config show --run demo                  # the run's settings as YAML
grpo stage rollouts --run demo --iteration 0 [--force]
grpo stage learn --run demo --iteration 0 --node-rank 1   # node 1 of a learner on learn.nodes machines
grpo run --run demo --iterations 3          # every stage of each iteration, in order
grpo sft --run chat [--force]                # the warm start a run's config sets (sft), before iteration 0
grpo demo                                    # init + train the tiny sort model until it sorts
grpo status --run demo
grpo query --run demo "SELECT iteration, avg(reward) FROM rewards GROUP BY 1"
grpo report --run demo                       # report.png and report.md in the run folder
grpo timeline --run demo                     # each iteration's stages against time (timeline.png)
grpo export --run demo                       # the newest policy as an HF folder under the run (LoRA merged)
grpo export --run demo --best ./demo-best    # the best by eval.metric, into a folder named (or --iteration k)
grpo export --run lora --adapter             # a LoRA run's adapter, unmerged (every export has a model card)
grpo export --run chat --sft                 # the warm start's policy (grpo sft), into exports/sft
grpo export --run demo --push-to-hub me/demo-grpo   # and upload it to the Hugging Face Hub (HF_TOKEN)
grpo k8s render [--stage learn]              # each stage's Kubernetes Job from deploy/kubernetes, as YAML
grpo fork --from demo --at 3 --run demo-gspo --set learn.loss_type=gspo   # iterations 0-2 by reference
grpo rescore --run demo --iterations 0:4 --set reward.truncated_reward=-1  # rewards again, no sampling
grpo delete --run demo-gspo --yes           # a run no other run references
"""

from __future__ import annotations

import os

# before torch loads: its C++ warnings (vLLM's NUMA binding note on CPU) print straight to stderr
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

import argparse  # noqa: E402
import importlib  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402

from grpo.errors import describe  # noqa: E402
from grpo.progress import show_in_terminal  # noqa: E402
from grpo.record.layout import OPTIONAL_STAGES, STAGES, STATE_STAGE  # noqa: E402
from grpo.runtime import threads  # noqa: E402
from grpo.runtime.quiet import quiet_libraries  # noqa: E402

# the commands' modules load when their command runs: `grpo --help` and `grpo status` import no torch, Prefect,
# pyarrow or pandas (tests/test_cli_speed.py); a command names its function as "module:function"
COMMANDS = "flows.commands"

ONE_LINE_ERRORS = {
    "grpo.config": "ConfigError",
    "grpo.errors": "StageError",
    "grpo.record.storage": "ArtifactError",
    "schemas.parquet": "SchemaError",
}
"""The errors a user acts on, printed as their one line with exit code 2: (module, class); a module the command
never imported raised none of its errors, so only those loaded are looked at."""


def one_line_error(e: BaseException) -> bool:
    """Whether `e` is one of ONE_LINE_ERRORS."""
    loaded = [getattr(sys.modules[m], name) for m, name in ONE_LINE_ERRORS.items() if m in sys.modules]
    return isinstance(e, tuple(loaded))


def _iterations_range(text: str) -> tuple[int, int]:
    """'A:B' (both included) or 'K'."""
    parts = text.split(":")
    if len(parts) > 2 or not all(p.isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: give A:B (iterations A to B, both included) or K")
    return int(parts[0]), int(parts[-1])


def _iteration(text: str) -> int | str:
    """An iteration argument: 'next' or an integer >= 0."""
    if text == "next":
        return text
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not an iteration: give an integer >= 0 or 'next'")
    return int(text)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="grpo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--storage", help="storage URL (default $GRPO_STORAGE or ./storage)")
    p.add_argument("-v", "--verbose", action="store_true")
    p.add_argument(
        "--threads",
        help="torch's CPU threads in this process and the grpo processes it starts: N, or cores/K for K processes "
        "sharing the machine (default $GRPO_THREADS, else torch's: one per core)",
    )
    sub = p.add_subparsers(dest="command", required=True)

    def with_config(sp):
        sp.add_argument("--config", help="YAML file of config sections (see grpo/config.py)")
        sp.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE")

    sp = sub.add_parser("init", help="create a run: config and base model")
    sp.add_argument("--run", required=True)
    with_config(sp)
    sp.set_defaults(fn="runs:cmd_init")
    sp = sub.add_parser("config", help="a run's settings: show them, or change those that may change")
    config = sp.add_subparsers(dest="config_command", required=True)
    sp = config.add_parser("show", help="the run's settings as YAML (a --config file for another run)")
    sp.add_argument("--run", required=True)
    sp.set_defaults(fn="settings:cmd_config_show")
    sp = config.add_parser(
        "set",
        help="change settings of a run, the rest as its run.json holds them",
        description="Changes what no committed result depends on: tracking, retention, eval.every, eval.metric, "
        "rollout.shards, rollout.device, reward.shards and where the learner runs (learn.nodes, "
        "learn.processes_per_node, learn.node_timeout_s, learn.state_every, learn.device; with learn.sharding=fsdp2 "
        "learn.num_processes). Anything else is refused in one line: `grpo fork` trains on with it.",
    )
    sp.add_argument("--run", required=True)
    sp.add_argument("settings", nargs="+", metavar="SECTION.FIELD=VALUE")
    sp.set_defaults(fn="settings:cmd_config_set")
    sp = sub.add_parser(
        "stage", help="run one stage of one iteration (or `state`: remake a learn's resume state by replaying it)"
    )
    sp.add_argument("name", choices=[*STAGES, *OPTIONAL_STAGES, STATE_STAGE])
    sp.add_argument("--run", required=True)
    sp.add_argument("--iteration", required=True, type=_iteration, help="an integer >= 0, or 'next'")
    sp.add_argument("--force", action="store_true", help="write a new attempt even if one is committed")
    sp.add_argument(
        "--shard",
        type=int,
        help="rollouts, rewards: only this shard (0-based) of rollout.shards or reward.shards; without it "
        "every shard not committed yet, then the stage",
    )
    sp.add_argument(
        "--node-rank",
        type=int,
        help="learn with learn.nodes > 1: run node r (1..nodes-1) of the learner on this machine; it joins node 0, "
        "the learn stage run without --node-rank, through storage and returns once node 0 committed",
    )
    sp.set_defaults(fn="runs:cmd_stage")
    sp = sub.add_parser("run", help="run whole iterations")
    sp.add_argument("--run", required=True)
    sp.add_argument("--iterations", type=int, default=1)
    sp.add_argument("--start", default="next", type=_iteration, help="first iteration (default: next unfinished)")
    sp.set_defaults(fn="runs:cmd_run")
    sp = sub.add_parser("sft", help="the warm start the run's config sets (sft): supervised steps before iteration 0")
    sp.add_argument("--run", required=True)
    sp.add_argument("--force", action="store_true", help="a new attempt beside a committed one")
    sp.set_defaults(fn="runs:cmd_sft")
    sp = sub.add_parser("demo", help="init (if needed) and train the tiny sort model until it sorts")
    sp.add_argument("--run", default="demo")
    sp.add_argument("--iterations", type=int, default=40, help="at most this many (default 40)")
    sp.add_argument("--target", type=float, default=0.9, help="stop at this held-out exact match (default 0.9)")
    with_config(sp)
    sp.set_defaults(fn="runs:cmd_demo")
    sp = sub.add_parser("status", help="iterations x stages of a run")
    sp.add_argument("--run", required=True)
    sp.add_argument("--verify", action="store_true", help="re-hash the newest attempts: 'corrupt' if they changed")
    sp.set_defaults(fn="audit:cmd_status")
    sp = sub.add_parser("gc", help="list (or --delete) failed and superseded attempts and temporary files")
    sp.add_argument("--run", required=True)
    sp.add_argument("--delete", action="store_true", help="remove them (default: only list)")
    sp.add_argument(
        "--older-than-s",
        type=float,
        default=3600.0,
        help="leave anything written, superseded or heartbeating more recently (a stage may be running): default 3600",
    )
    sp.add_argument(
        "--retention",
        action="store_true",
        help="also the weights and optimizer state of older learns that the run's retention settings "
        "(retention.keep_last, retention.keep_every; the best eval is kept) do not keep; never tables",
    )
    sp.set_defaults(fn="cleanup:cmd_gc")
    sp = sub.add_parser("fork", help="a new run from another's committed iterations, by reference, with new settings")
    sp.add_argument("--from", dest="parent", required=True, help="the run to fork")
    sp.add_argument(
        "--at", type=int, required=True, help="the first iteration of the fork's own (before it: the parent's)"
    )
    sp.add_argument("--run", required=True, help="the new run's id")
    sp.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    sp.set_defaults(fn="forks:cmd_fork")
    sp = sub.add_parser("rescore", help="score a run's committed rollouts again with another reward, in a fork")
    sp.add_argument("--run", required=True)
    sp.add_argument(
        "--iterations", type=_iterations_range, help="A:B, both included, or K (default: every finished iteration)"
    )
    sp.add_argument("--set", action="append", default=[], metavar="reward.FIELD=VALUE")
    sp.add_argument("--as", dest="as_run", help="the fork's run id (default RUN-rescore-A-B-<hash of --set>)")
    sp.set_defaults(fn="forks:cmd_rescore")
    sp = sub.add_parser("delete", help="remove a run that no other run (a fork) references")
    sp.add_argument("--run", required=True)
    sp.add_argument("--yes", action="store_true", help="delete it (default: only say what it holds)")
    sp.set_defaults(fn="cleanup:cmd_delete")
    sp = sub.add_parser("export", help="write a policy as a self-contained HF folder (LoRA adapters merged)")
    sp.add_argument("--run", required=True)
    sp.add_argument("dir", nargs="?", help="a new local folder or fsspec URL (or --out DIR); default: under the run")
    sp.add_argument("--out", help="the same as DIR")
    which = sp.add_mutually_exclusive_group()
    which.add_argument("--iteration", type=int, help="the policy the learn of this iteration committed")
    which.add_argument("--best", action="store_true", help="the best iteration's policy by eval.metric")
    which.add_argument("--latest", action="store_true", help="the newest committed policy (the default)")
    which.add_argument("--sft", action="store_true", help="the warm start's policy (`grpo sft`); default exports/sft")
    sp.add_argument(
        "--adapter",
        action="store_true",
        help="a LoRA run: the peft adapter alone, unmerged (adapter_config.json, adapter_model.safetensors, the "
        "tokenizer), for PeftModel.from_pretrained over the base; default folder exports/iter-000k-adapter",
    )
    sp.add_argument(
        "--push-to-hub",
        metavar="REPO",
        help="then upload the folder, model card included, to this Hugging Face Hub model repository (OWNER/NAME, or "
        "NAME under the token's owner; created if missing): the token from HF_TOKEN or `hf auth login`",
    )
    sp.add_argument("--private", action="store_true", help="with --push-to-hub: a repository created is private")
    sp.set_defaults(fn="export:cmd_export")
    sp = sub.add_parser("report", help="plot a run's progress: report.png and report.md in its folder")
    sp.add_argument("--run", required=True)
    sp.add_argument(
        "--compare",
        nargs="+",
        metavar="RUN",
        help="overlay these runs' curves on the run's (a parent and its forks): compare.png and compare.md",
    )
    sp.set_defaults(fn="audit:cmd_report")
    sp = sub.add_parser(
        "timeline", help="each iteration's stages against time (timeline.png): where sampling and learning overlap"
    )
    sp.add_argument("--run", required=True)
    sp.set_defaults(fn="audit:cmd_timeline")
    sp = sub.add_parser("k8s", help="Kubernetes: see the Jobs the deploy/kubernetes work pools create")
    k8s = sp.add_subparsers(dest="k8s_command", required=True)
    sp = k8s.add_parser(
        "render",
        help="print each stage's Kubernetes Job as YAML (offline: no cluster, no Prefect server)",
        description="The Job a kubernetes worker creates for a flow run of deploy/kubernetes' deployments, rendered "
        "by prefect-kubernetes' own code; by default each stage's, as grpo/k8s-placed places it. Placeholder flow "
        "run ids: to read and diff, not to apply.",
    )
    sp.add_argument("--stage", action="append", choices=STAGES, help="only this stage (repeatable; default: all six)")
    sp.add_argument("--deployment", help="instead, a deployment's flow run: grpo/k8s-gpu, grpo/k8s-placed, ...")
    sp.add_argument("--run", default="k1", help="the run id the flow run is named after (default k1)")
    sp.add_argument("--iteration", type=int, default=0, help="the iteration it is named after (default 0)")
    sp.add_argument("--prefect-file", help="the deployments (default: this checkout's deploy/kubernetes/prefect.yaml)")
    sp.set_defaults(fn="k8s:cmd_k8s_render")
    sp = sub.add_parser(
        "query",
        help="DuckDB SQL over the committed tables of a run",
        description="views: rollouts, rewards, advantages, logprobs, learn_metrics, eval, with episodes turns and "
        "episodes (newest committed attempt of each iteration; see grpo/query.py), and io (bytes and seconds each "
        "committed stage moved through storage, from its manifest)",
    )
    sp.add_argument(
        "--run",
        required=True,
        action="append",
        help="the run; again for more runs: their views as <run>.<view>, all of them as runs.<view> (a run column)",
    )
    sp.add_argument("sql", help='e.g. "SELECT iteration, avg(reward) FROM rewards GROUP BY 1 ORDER BY 1"')
    sp.add_argument("--no-verify", action="store_true", help="skip the sha256 check of the files read")
    sp.set_defaults(fn="audit:cmd_query")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    level = logging.INFO if args.verbose else logging.WARNING
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(message)s")
    for handler in logging.getLogger().handlers:  # the stages log at INFO; shown with -v
        handler.setLevel(level)
    quiet_libraries(args.verbose)
    logging.getLogger("grpo").setLevel(logging.INFO)
    if not args.verbose:  # -v prints the progress records as log lines
        show_in_terminal()
    try:
        if args.threads:
            os.environ[threads.ENV] = args.threads
        threads.apply_threads()  # now if torch is loaded, else as torch loads (a command that never needs it)
        module, fn = args.fn.split(":")
        from grpo.record.storage import open_storage

        getattr(importlib.import_module(f"{COMMANDS}.{module}"), fn)(args, open_storage(args.storage))
    except BrokenPipeError:  # `grpo query ... | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 0
    except Exception as e:  # storage, network, OS, parsing: one line; -v or GRPO_DEBUG=1 shows the traceback
        if one_line_error(e):
            print(f"grpo: error: {e}", file=sys.stderr)
            return 2
        if args.verbose or os.environ.get("GRPO_DEBUG"):
            raise
        print(
            f"grpo: error: {describe(e, args.storage or os.environ.get('GRPO_STORAGE', ''))} (-v for the traceback)",
            file=sys.stderr,
        )
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
