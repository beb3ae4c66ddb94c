"""The shape of the house, read from the code's own imports (every import, those inside functions too):
no import cycle (of modules, nor of grpo/'s wings and rooms), no import from a lower floor to a higher one (schemas <
grpo < stages, tools < flows < benchmarks), grpo/ as wings and a few standalone modules on at most six levels, one
room each for hashing and liveness, stage modules that read alone, no private API outside its one shim, and every
module's doctests."""

import ast
import doctest
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FLOORS = {"schemas": 0, "grpo": 1, "stages": 2, "tools": 2, "flows": 3, "benchmarks": 4}
# stages/<name>.py: one stage each (sft: the run's warm start, once)
STAGE_MODULES = ["snapshot", "rollouts", "rewards", "advantages", "learn", "eval", "sft"]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for floor in FLOORS for p in sorted((ROOT / floor).rglob("*.py"))}


def imported(path: Path) -> set[str]:
    """The project modules `path` imports: `from grpo import core` is grpo.core, `from grpo.core import x` grpo.core."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out |= {
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else node.module for a in node.names
            }
    return {m for m in out if m in MODULES}


GRAPH = {name: imported(path) - {name} for name, path in MODULES.items()}


def floor(module: str) -> int:
    return FLOORS[module.split(".")[0]]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_guards_see_what_they_guard():
    """The checks below fail on the shapes they forbid (a circle, an import from floor 1 to floor 2)."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    assert floor("grpo.learner.loop") < floor("stages.learn") < floor("flows.grpo")
    assert "grpo.learner.sharding" in GRAPH["grpo.learner.loop"] and "stages.common" in GRAPH["stages.learn"]


def test_no_import_cycle():
    assert cycles(GRAPH) == []


FACE = {("grpo", "flows.api")}
"""The one import up a floor: the package's face, `from grpo import train` (the Python API beside the command line),
loaded when asked for."""


def test_no_import_runs_up_a_floor():
    upward = sorted((a, b) for a, deps in GRAPH.items() for b in deps if floor(b) > floor(a))
    assert upward == sorted(FACE)


def test_a_stage_imports_another_stage_only_for_its_function_or_identity():
    """No stage module is imported by another for machinery: that belongs to grpo/ (learner, scoring, sampling)."""
    allowed = {"stage_config", *STAGE_MODULES, "evaluate"}
    for name in STAGE_MODULES:
        tree = ast.parse(MODULES[f"stages.{name}"].read_text())
        modules = set()  # `from stages import rewards`: the names of other stage modules used as modules here
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module in {f"stages.{s}" for s in STAGE_MODULES}:
                assert {a.name for a in node.names} <= allowed, (name, node.module)
            if isinstance(node, ast.ImportFrom) and node.module == "stages":
                modules |= {a.asname or a.name for a in node.names if a.name in STAGE_MODULES}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
                assert node.attr in allowed, (name, ast.unparse(node))


def test_stage_files_read_alone():
    assert {n: len(MODULES[f"stages.{n}"].read_text().splitlines()) for n in STAGE_MODULES} == pytest.approx(
        {n: 0 for n in STAGE_MODULES}, abs=320
    )
    assert len(MODULES["flows.grpo"].read_text().splitlines()) <= 200


def test_cli_files_read_alone():
    """flows/cli.py is the command line (usage, parser, main); flows/commands/ what commands do, a concept a file."""
    cli = [m for m in MODULES if m == "flows.cli" or m.startswith("flows.commands.")]
    assert len(cli) > 1
    assert {m: len(MODULES[m].read_text().splitlines()) for m in cli} == pytest.approx({m: 0 for m in cli}, abs=300)


@pytest.mark.parametrize(
    "name",
    [m for m, p in MODULES.items() if m.startswith(("grpo", "stages", "flows", "schemas")) and ">>>" in p.read_text()],
)
def test_doctests(name):
    result = doctest.testmod(importlib.import_module(name))
    assert result.attempted and result.failed == 0


# ---------------------------------------------------------------- grpo/: wings and rooms

WINGS = {"record", "learner", "sampling", "scoring", "tasks", "runtime", "episodes", "tracking"}
"""The packages of grpo/: an engine or the run record each, one component a file, a face listing its rooms."""
STANDALONE = {
    "config", "core", "variants", "errors", "data", "devices", "tiny_model", "progress", "query", "report", "gc",
    "trl_names", "api",
}  # fmt: skip
"""The modules of grpo/ that stand alone: one concept each, no wing of their own."""
STAGE_PARTS = {"common": "every stage", "prompts": "rollouts", "dynamic_sampling": "rollouts", "shards": "rollouts",
               "samples": "rollouts (and eval's episodes)", "segments": "rollouts (partial rollouts)",
               "learn_data": "learn", "init": "the run's base", "rescore": "a fork's rewards",
               "iteration": "the stages in order", "held_out": "eval (and sft's gate)",
               "sft_sources": "sft"}  # fmt: skip
"""The modules of stages/ besides the stage modules: each a part of the stage (or stages) it names."""


def room(module: str) -> str | None:
    """grpo.record.storage -> grpo.record (its wing); grpo.core -> grpo.core; None outside grpo/."""
    parts = module.split(".")
    if parts[0] != "grpo" or len(parts) == 1:
        return None
    return ".".join(parts[:2])


def levels(graph: dict[str, set[str]]) -> dict[str, int]:
    """Each room's import level: 1 + the highest level of the rooms it imports (1: imports none)."""
    out: dict[str, int] = {}

    def level(r: str) -> int:
        if r not in out:
            out[r] = 0  # a circle would recurse forever, and count quietly here: test_no_circle_of_rooms guards it
            out[r] = 1 + max((level(d) for d in graph[r]), default=0)
        return out[r]

    for r in graph:
        level(r)
    return out


ROOMS: dict[str, set[str]] = {}
for _m, _deps in GRAPH.items():
    if room(_m):
        ROOMS.setdefault(room(_m), set()).update(room(d) for d in _deps if room(d) and room(d) != room(_m))


def test_no_circle_of_rooms():
    """No two rooms of grpo/ (a wing, a standalone module) import each other, however indirectly: a circle of modules
    the module-level check cannot see (wing A's x imports wing B's y, B's z imports A's w) is one of wings here."""
    assert cycles({"a.x": {"b.y"}, "b.y": set(), "b.z": {"a.w"}, "a.w": set()}) == []  # the modules': no circle
    assert cycles({"a": {"b"}, "b": {"a"}}) == [["a", "b"]]  # the same as rooms: one
    assert cycles(ROOMS) == []


def test_levels_are_counted_as_they_should_be():
    assert levels({"a": {"b"}, "b": {"c"}, "c": set()}) == {"a": 3, "b": 2, "c": 1}
    assert room("grpo.record.storage") == "grpo.record" and room("stages.learn") is None


def test_every_module_of_grpo_is_in_a_wing_or_named_standalone():
    top = {p.stem if p.is_file() else p.name for p in (ROOT / "grpo").iterdir() if p.name != "__pycache__"}
    top -= {"__init__"}
    wings = {n for n in top if (ROOT / "grpo" / n).is_dir()}
    assert wings <= WINGS, f"a new wing: add it to WINGS with a face (its __init__ listing its rooms): {wings - WINGS}"
    assert top - wings <= STANDALONE, f"name these in STANDALONE or move them into a wing: {top - wings - STANDALONE}"
    assert len(top - wings) <= 12
    for wing in wings:
        face = (ROOT / "grpo" / wing / "__init__.py").read_text()
        files = [p.name for p in sorted((ROOT / "grpo" / wing).glob("*.py")) if p.name != "__init__.py"]
        assert all(f in face for f in files), f"grpo/{wing}/__init__.py lists its rooms: {files}"


def test_grpo_has_at_most_six_import_levels():
    got = levels(ROOMS)
    assert max(got.values()) <= 6, sorted(got.items(), key=lambda kv: kv[1])


def test_hashing_and_liveness_each_live_in_one_module():
    """Every memo of a file's sha256 is defined in grpo/record/digests.py; every reader and writer of heartbeats in
    grpo/record/liveness.py (gc, placement, the state commit and the learner's nodes ask it)."""
    import re

    hashing = re.compile(r"^\s*(def|class) \w*(sha256|digest|Stamp|stamp_)\w*", re.M)
    beat = "heartbeat|Heartbeat|storage_clock|running_attempts|lost_attempts|Watched|read_beat|last_beat"
    beating = re.compile(rf"^\s*(def|class) \w*({beat})\w*", re.M)
    for name, path in MODULES.items():
        text = path.read_text()
        if name not in ("grpo.record.digests", "grpo.record.pins"):  # pins.py: a dataset's own content hash (D4)
            assert not hashing.search(text), (name, hashing.search(text).group(0))
        if name != "grpo.record.liveness":
            assert not beating.search(text), (name, beating.search(text).group(0))
    assert "grpo.gc" not in GRAPH["flows.placement"] and "grpo.gc" not in GRAPH["grpo.record.resume"]
    assert not {"grpo.report", "grpo.tracking"} & GRAPH["grpo.gc"]
    assert "matplotlib" not in MODULES["grpo.gc"].read_text()
    assert not any(m.startswith(("grpo.learner", "stages", "flows")) for m in GRAPH["grpo.record.resume"])


def test_no_stage_or_wing_module_is_over_400_lines_and_stages_holds_only_stages():
    long = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > 400}
    assert not {m: n for m, n in long.items() if m.startswith("stages.") or (room(m) or "").split(".")[-1] in WINGS}
    stages = {m.split(".")[1] for m in MODULES if m.startswith("stages.")}
    assert stages - set(STAGE_MODULES) - {"stages"} == set(STAGE_PARTS) & stages
    assert stages - set(STAGE_MODULES) <= set(STAGE_PARTS) | {"stages"}, "a new module in stages/ that is no stage"


def test_no_private_api_outside_its_one_shim():
    """threading._x and sys._x only in grpo/runtime/exits.py, which says why."""
    import re

    private = re.compile(r"\b(threading|sys)\._[a-z]")
    found = [m for m, p in MODULES.items() if m != "grpo.runtime.exits" and private.search(p.read_text())]
    assert found == []
