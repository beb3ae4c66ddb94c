"""The shape of the house, read from the code's own imports (every import, those inside functions too):
no import cycle, no import from a lower floor to a higher one (schemas < grpo < stages, tools < flows <
benchmarks), stage modules that read alone, and every module's doctests."""

import ast
import doctest
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FLOORS = {"schemas": 0, "grpo": 1, "stages": 2, "tools": 2, "flows": 3, "benchmarks": 4}
STAGE_MODULES = ["snapshot", "rollouts", "rewards", "advantages", "learn", "eval"]  # stages/<name>.py: one stage each


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
