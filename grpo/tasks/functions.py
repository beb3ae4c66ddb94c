"""User reward functions (`reward.functions`) and the one scorer every stage calls.

A reward function is a plain function `(response, ground_truth, prompt, **row)` returning a
float, or a dict of named components with `total`; `row` holds the dataset's other columns
(a function gets those it names, or all of them with `**row`), and in a run of episodes
`environment` and `messages` (grpo.tasks.base.EPISODE_ARGUMENTS). It is named as
`path/to/file.py:function` (the file is copied into the run at `grpo init`, so every stage,
worker and machine scores with the same code), `package.module:function` (imported by name), or a callable
handed to `grpo.train` (cloudpickled, named `pickled/<name>-<sha256>.pkl:<name>`, its bytes copied into the run
as a file's are). A function in TRL's shape, `(completions, **kwargs) -> list[float]` (a parameter of TRL_ARGUMENTS:
`completions`, `environments`, ...), is called one sample at a time with lists of one: `prompts`, `completions`,
`ground_truth` and each dataset column, and in a run of episodes `completions` as message lists and `environments`
(grpo/tasks/trl_rewards.py).

With several functions, a sample's reward is the weighted sum of their totals; each one's
total is stored under its name and its other components as `name/component`.

    >>> score = Scorer.for_task("arithmetic", {})
    >>> score("11", "11", "3 + 4 * 2 =", {})
    {'format': 1.0, 'correct': 1.0, 'total': 1.0}
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import inspect
import math
import os
import sys
from typing import Callable

from grpo.tasks import get_task

REWARD_PREFIX = "reward/"  # where a run's base commit keeps copies of reward files
ROLLOUT_FUNC_PREFIX = "rollout_func/"  # and of the file rollout.rollout_func names


class UserCodeError(ValueError):
    """Code a setting names (a reward function, a tool, an environment class) cannot be found or imported."""


class RewardFunctionError(UserCodeError):
    """A reward function cannot be found, imported or called as a reward."""


def is_file_spec(spec: str) -> bool:
    """Whether `spec` names a file (`path.py:function`) rather than a module.

    >>> is_file_spec("rewards/mine.py:score"), is_file_spec("mypkg.rewards:score")
    (True, False)
    """
    return spec.rpartition(":")[0].endswith(".py")


PICKLED = "pickled/"  # the pseudo-folder of a pickled callable's spec

_PICKLES: dict[str, bytes] = {}
"""spec -> the cloudpickled bytes of a callable handed to grpo.train in this process (`grpo init` copies them into
the run; later processes read the run's copy)."""


def is_pickled_spec(spec: str) -> bool:
    """Whether `spec` names a cloudpickled callable (pickle_callable).

    >>> is_pickled_spec("pickled/exact-0123456789abcdef.pkl:exact"), is_pickled_spec("r.py:exact")
    (True, False)
    """
    return spec.startswith(PICKLED) and spec.rpartition(":")[0].endswith(".pkl")


def has_copy(spec: str) -> bool:
    """Whether the run keeps a copy of what `spec` names (a file, or a pickled callable)."""
    return is_file_spec(spec) or is_pickled_spec(spec)


def pickle_callable(fn: Callable, index: int) -> str:
    """The spec of `fn`, cloudpickled and kept in this process for `grpo init` to copy; named after the function
    (reward_<index> for a lambda) and its bytes' hash. A function of a script or of a module of your own travels by
    value (its code in the bytes: a later process needs no import of it); one of an installed package (or of
    grpo) by reference."""
    import cloudpickle

    module = sys.modules.get(getattr(fn, "__module__", None) or "")
    by_value = module is not None and module.__name__ != "__main__" and own_code(module)
    if by_value:
        cloudpickle.register_pickle_by_value(module)
    try:
        data = cloudpickle.dumps(fn)
    finally:
        if by_value:
            cloudpickle.unregister_pickle_by_value(module)
    name = getattr(fn, "__name__", "")
    name = name if name.isidentifier() else f"reward_{index}"
    spec = f"{PICKLED}{name}-{hashlib.sha256(data).hexdigest()[:16]}.pkl:{name}"
    _PICKLES[spec] = data
    return spec


def own_code(module) -> bool:
    """A module of the user's own: neither installed (site-packages, the standard library) nor grpo-flow's, nor built
    in."""
    path = getattr(module, "__file__", None) or ""
    installed = any(part in ("site-packages", "dist-packages") for part in path.split(os.sep))
    installed |= path.startswith(os.path.join(sys.base_prefix, "lib"))  # the standard library
    return bool(path) and not installed and module.__name__.split(".")[0] not in ("grpo", "stages", "flows")


def pickled_bytes(spec: str) -> bytes:
    """The bytes of a pickled callable handed to grpo.train in this process."""
    if spec not in _PICKLES:
        raise RewardFunctionError(
            f"reward.functions: {spec!r} is a callable that grpo.train pickled in another process, and this run holds "
            "no copy of it yet: pass the callable to grpo.train again"
        )
    return _PICKLES[spec]


def split_spec(spec: str, setting: str = "reward.functions") -> tuple[str, str]:
    """`target:function` -> (target, function); a spec without both, or whose target is neither a .py file nor a
    module's dotted name (a path such as ../../etc/passwd), fails naming it.

    >>> split_spec("../../etc/passwd:x", "rollout.tools")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    grpo.tasks.functions.RewardFunctionError: rollout.tools: '../../etc/passwd:x' names '../../etc/passwd', neither...
    """
    target, _, name = spec.rpartition(":")
    if not target or not name.isidentifier():
        raise RewardFunctionError(
            f"{setting}: {spec!r} is not of the form path/to/file.py:function or package.module:function"
        )
    module = all(part.isidentifier() for part in target.split("."))
    if not (module or target.endswith(".py") or target.startswith(PICKLED)):
        raise RewardFunctionError(
            f"{setting}: {spec!r} names {target!r}, neither a .py file nor a module (package.module): name a file "
            f"path/to/file.py:{name} or an importable module"
        )
    return target, name


def committed_name(index: int, spec: str, prefix: str = REWARD_PREFIX) -> str:
    """File name of the copy of file `index` of a setting (reward.functions; a tool's: `prefix`) in the run's base
    commit."""
    return f"{prefix}{index}-{os.path.basename(split_spec(spec)[0])}"


def _module_from_file(path: str):
    digest = hashlib.sha256(os.path.abspath(path).encode()).hexdigest()[:12]
    name = f"grpo_reward_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def load_object(spec: str, file: str | None = None, setting: str = "reward.functions") -> Callable:
    """The callable (a function, a class) `spec` names; `file` overrides the path of a file spec (the run's committed
    copy). Errors name `setting`."""
    target, name = split_spec(spec, setting)
    try:
        if is_file_spec(spec):
            path = file or target
            if not os.path.isfile(path):
                raise RewardFunctionError(f"{setting}: {spec!r}: no file {path}")
            module = _module_from_file(path)
        else:
            module = importlib.import_module(target)
    except RewardFunctionError:
        raise
    except Exception as e:  # noqa: BLE001 (whatever the user's module raises on import)
        raise RewardFunctionError(f"{setting}: {spec!r}: import failed: {type(e).__name__}: {e}") from e
    fn = getattr(module, name, None)
    if not callable(fn):
        raise RewardFunctionError(f"{setting}: {spec!r}: {target} has no function {name!r}")
    return fn


def load_function(spec: str, file: str | None = None) -> Callable:
    """The function `spec` names (a file's, a module's, or a callable grpo.train pickled), checked to take
    (response, ground_truth, prompt); `file` overrides the path of a file spec (the run's committed copy)."""
    target, name = split_spec(spec)
    fn = _unpickled(spec, file) if is_pickled_spec(spec) else load_object(spec, file)
    return _checked(spec, fn, target, name)


def _unpickled(spec: str, file: str | None) -> Callable:
    """A pickled callable: from the run's copy (`file`), else from this process (pickled_bytes)."""
    import cloudpickle

    data = open(file, "rb").read() if file else pickled_bytes(spec)
    try:
        return cloudpickle.loads(data)
    except Exception as e:  # noqa: BLE001 (a module the callable needs is missing here, ...)
        raise RewardFunctionError(f"reward.functions: {spec!r}: unpickling failed: {type(e).__name__}: {e}") from e


def _checked(spec: str, fn, target: str, name: str) -> Callable:
    """`fn`, in TRL's shape made per sample, checked to take (response, ground_truth, prompt)."""
    if not callable(fn):
        raise RewardFunctionError(f"reward.functions: {spec!r}: {target} has no function {name!r}")
    from grpo.tasks.trl_rewards import per_sample, trl_shaped

    if trl_shaped(fn):
        fn = per_sample(fn)
    try:
        sig = inspect.signature(fn)
        sig.bind("response", "ground_truth", "prompt", **{n: None for n in required_columns(fn)})
    except (TypeError, ValueError) as e:
        raise RewardFunctionError(
            f"reward.functions: {spec!r}: signature {inspect.signature(fn)} does not take "
            "(response, ground_truth, prompt, **row)"
        ) from e
    return fn


def columns_needed(spec: str) -> list[str] | str:
    """The dataset columns the function `spec` names needs, sorted; or the line saying why it does not load. What
    `grpo init` asks a reward worker, so that a reward file's module-level code runs where scoring runs it.

    >>> columns_needed("grpo.tasks.functions:nothing")
    "reward.functions: 'grpo.tasks.functions:nothing': grpo.tasks.functions has no function 'nothing'"
    """
    try:
        return sorted(required_columns(load_function(spec)))
    except RewardFunctionError as e:
        return str(e)


def required_columns(fn: Callable) -> set[str]:
    """Dataset columns `fn` needs: its parameters after the first three that have no default (a function in TRL's
    shape: those TRL does not give, and `environments`, which an episode's environment gives)."""
    if hasattr(fn, "trl_needs"):
        return set(fn.trl_needs)
    params = list(inspect.signature(fn).parameters.values())[3:]
    return {p.name for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def _row_keywords(fn: Callable) -> Callable[[dict], dict]:
    """What of a row `fn` takes: all of it with **kwargs, else the keyword names it declares."""
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return lambda row: row
    names = {p.name for p in list(params)[3:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return lambda row: {k: v for k, v in row.items() if k in names}


MAX_COMPONENTS = 256
"""Named components a reward function may return for one sample (each is a column entry of every row)."""


def components_of(value, where: str) -> dict[str, float]:
    """A reward function's return value as named float components with `total`, each finite (a NaN component
    would be committed beside a finite total, and poison any mean of it).

    >>> components_of({"total": 1.0, "format": float("nan")}, "score")
    Traceback (most recent call last):
    ValueError: score: non-finite component 'format': nan
    """
    comps = {"total": value} if isinstance(value, (int, float)) else value
    if not isinstance(comps, dict) or "total" not in comps:
        raise TypeError(f"{where} returned {type(value).__name__}; return a float or a dict with 'total'")
    if len(comps) > MAX_COMPONENTS:
        raise ValueError(f"{where} returned {len(comps)} components; return at most {MAX_COMPONENTS}")
    out = {str(k): float(v) for k, v in comps.items()}
    if not math.isfinite(out["total"]):
        raise ValueError(f"{where}: non-finite reward {out['total']}")
    if bad := next((k for k, v in out.items() if not math.isfinite(v)), None):
        raise ValueError(f"{where}: non-finite component {bad!r}: {out[bad]}")
    return out


class Scorer:
    """Scores one sample: the task's reward, or the weighted user functions.

    Built from plain values, so a forked worker builds the same one (`cached`).
    """

    def __init__(self, fns: list[tuple[str, Callable]], weights: list[float]):
        self.fns = [(name, fn, _row_keywords(fn)) for name, fn in fns]
        self.weights = weights

    @classmethod
    def for_task(cls, task_name: str, params: dict) -> Scorer:
        task = get_task(task_name, **params)
        return cls(
            [(task_name, lambda response, ground_truth, prompt, **_: task.reward(response, ground_truth, prompt))],
            [1.0],
        )

    @classmethod
    def for_functions(cls, specs: list[str], weights: list[float] | None, files: list[str | None]) -> Scorer:
        fns = [(n, load_function(s, f)) for n, s, f in zip(function_names(specs), specs, files)]
        return cls(fns, list(weights) if weights else [1.0] * len(fns))

    def __call__(
        self, response: str, ground_truth: str, prompt: str, row: dict, calling: Callable[[int], None] | None = None
    ) -> dict[str, float]:
        """The sample's components and `total`; `calling(i)` is told before function i runs (a pool
        worker's watchdog then names the function that hung or killed the worker). An episode whose environment
        has a reward of its own (a TRL class's get_reward) adds it, weight 1, as the component `environment`."""
        out = self._functions(response, ground_truth, prompt, row, calling)
        own = getattr(row.get("environment"), "_state", {}).get("get_reward")
        if own is None:
            return out
        total = out["total"] + float(own)
        if not math.isfinite(total):
            raise ValueError(f"non-finite reward {total}: the environment's get_reward() gave {own}")
        if len(self.fns) == 1 and self.weights == [1.0]:  # the function's own total, kept beside the environment's
            out = {**out, self.fns[0][0]: out["total"]}
        return {**out, "environment": float(own), "total": total}

    def _functions(self, response: str, ground_truth: str, prompt: str, row: dict, calling) -> dict[str, float]:
        if len(self.fns) == 1 and self.weights == [1.0]:
            name, fn, keywords = self.fns[0]
            return components_of(fn(response, ground_truth, prompt, **keywords(row)), name)
        out, total = {}, 0.0
        for i, ((name, fn, keywords), w) in enumerate(zip(self.fns, self.weights)):
            if calling is not None:
                calling(i)
            comps = components_of(fn(response, ground_truth, prompt, **keywords(row)), name)
            out.update({f"{name}/{k}": v for k, v in comps.items() if k != "total"})
            out[name] = comps["total"]
            total += w * comps["total"]
        if not math.isfinite(total):  # finite totals whose weighted sum overflows float64
            terms = " + ".join(f"{w:g} * {name} ({out[name]:.3g})" for (name, _, _), w in zip(self.fns, self.weights))
            raise ValueError(f"non-finite reward {total}: {terms} overflows; scale the rewards down")
        out["total"] = total
        return out


def function_names(specs: list[str] | tuple[str, ...]) -> list[str]:
    """The name each function's total is stored under: its function name, numbered when repeated.

    >>> function_names(["a.py:score", "b.py:score", "pkg.m:length"])
    ['score', 'score_1', 'length']
    """
    names: list[str] = []
    for spec in specs:
        name = split_spec(spec)[1]
        names.append(name if name not in names else f"{name}_{len(names)}")
    return names


def reward_source(task_name: str, specs: list[str] | tuple[str, ...], components: dict[str, float]) -> str:
    """What gave a sample its reward, for an error message: the task, the one function, or of several
    functions the one whose total is largest in magnitude in `components` (a Scorer's output).

    >>> reward_source("sort", [], {"total": 1.0})
    'task sort'
    >>> reward_source("sort", ["r.py:a", "r.py:b"], {"a": 1.0, "b": -1e308, "total": -1e308})
    "reward function 'r.py:b'"
    """
    if not specs:
        return f"task {task_name}"
    names = function_names(specs)
    if len(specs) == 1:
        return f"reward function {specs[0]!r}"
    biggest = max(range(len(specs)), key=lambda i: abs(components.get(names[i], 0.0)))
    return f"reward function {specs[biggest]!r}"


@functools.lru_cache(maxsize=4)
def cached(task_name: str, params: tuple, specs: tuple, weights: tuple | None, files: tuple) -> Scorer:
    """The scorer of these plain values, built once per process (a pool worker scores many jobs)."""
    if specs:
        return Scorer.for_functions(list(specs), list(weights) if weights else None, list(files))
    return Scorer.for_task(task_name, dict(params))
