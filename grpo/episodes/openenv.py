"""Adapter: a gym-style reset/step environment served over HTTP by its own package, through OpenEnv's client.

rollout.environment names the server by its URL (`http://127.0.0.1:8000`): an environment written for OpenEnv
(`openenv-core`: an `Environment` subclass with reset/step, served by `create_app(...)` under uvicorn, in its own
process, container or Space). Each episode is one session of the server (OpenEnv's `GenericEnvClient`, a WebSocket
of its own, one environment instance on the server): `reset(seed=..., **row)` starts it, each assistant turn becomes
one action, the observation answers it as the next message, and the step's reward and done are recorded
(`final`, for the reward functions). The server's action schema (GET /schema) says how a turn becomes an action:
  - an action of one string field (a text game's `message`, a shell's `command`): the turn's text is that field;
    the observation comes back as a user message;
  - any other action: the model calls one tool, `step`, whose parameters are the action's fields; its arguments
    are the action, the observation the tool's result; a turn without a call ends the episode (as TRL's tools).
An observation with one string field is that text, any other its fields as JSON. The episode ends when the server
says done (or at rollout.max_turns). The server must allow as many sessions as episodes run at once (the G episodes
of a chunk's prompts: `create_app(..., max_concurrent_envs=N)`), as with TRL's environment_factory over OpenEnv.

Errors: an action the server rejects or whose step raises is the model's to see (its message the observation,
counted); a server that cannot be reached, refuses a session or stops answering (rollout.tool_timeout_s) is an
EnvironmentFailure: the stage fails in one line naming the server.
"""

from __future__ import annotations

import json
from typing import Callable

from grpo.config import ConfigError
from grpo.episodes.adapters import Source
from grpo.episodes.environment import EnvironmentFailure, Reply, ToolCall

STEP = "step"  # the tool's name when the action is not one string
_MODEL_ERRORS = ("VALIDATION_ERROR", "EXECUTION_ERROR", "INVALID_JSON")  # the server answered: the action was wrong


def text_field(action_schema: dict) -> str | None:
    """The action's one string field, when it has only that one (besides OpenEnv's `metadata`); else None.

    >>> text_field({"properties": {"message": {"type": "string"}, "metadata": {"type": "object"}}})
    'message'
    >>> text_field({"properties": {"row": {"type": "integer"}, "col": {"type": "integer"}}}) is None
    True
    """
    fields = {k: v for k, v in action_schema.get("properties", {}).items() if k != "metadata"}
    (name, spec), *rest = list(fields.items()) or [(None, {})]
    return name if not rest and spec.get("type") == "string" else None


def step_tool(action_schema: dict) -> dict:
    """The `step` tool's JSON schema (transformers' form) from the server's action schema.

    >>> tool = step_tool({"title": "Move", "description": "Where to go.", "properties": {"to": {"type": "integer"}},
    ...                   "required": ["to"]})["function"]
    >>> tool["name"], tool["description"], tool["parameters"]["properties"], tool["parameters"]["required"]
    ('step', 'Where to go.', {'to': {'type': 'integer'}}, ['to'])
    """
    fields = {k: v for k, v in action_schema.get("properties", {}).items() if k != "metadata"}
    parameters = {"type": "object", "properties": fields, "required": action_schema.get("required", [])}
    if "$defs" in action_schema:
        parameters["$defs"] = action_schema["$defs"]
    description = action_schema.get("description") or f"Act in the environment: one {action_schema.get('title')}."
    return {"type": "function", "function": {"name": STEP, "description": description, "parameters": parameters}}


def observation_text(observation: dict) -> str:
    """What the model reads of an observation: its one string field, else its fields as JSON.

    >>> observation_text({"prompt": "higher"}), observation_text({"x": 1, "y": "a"})
    ('higher', '{"x": 1, "y": "a"}')
    """
    if len(observation) == 1 and isinstance(next(iter(observation.values())), str):
        return next(iter(observation.values()))
    return json.dumps(observation)


class OpenEnvEpisode:
    """One episode: a session of the server through OpenEnv's sync client, the steps' rewards and done."""

    def __init__(self, url: str, field: str | None, schemas: list[dict], timeout_s: float):
        from openenv.core import GenericEnvClient

        self.url, self.field, self.schemas, self.timeout_s = url, field, schemas, timeout_s
        self.client = GenericEnvClient(base_url=url, message_timeout_s=timeout_s).sync()
        self.rewards: list[float | None] = []
        self.done, self.observation = False, None

    def tools(self) -> list[dict]:
        return self.schemas

    def reset(self, row: dict, seed: int) -> list[dict]:
        row = {k: v for k, v in row.items() if k not in ("seed", "episode_id")}
        result = self._call("reset", seed=seed, **row)
        if isinstance(result, str):
            raise EnvironmentFailure(f"OpenEnv server {self.url}: reset failed: {result}")
        self.observation = result.observation
        text = observation_text(result.observation) if result.observation else ""
        return [{"role": "user", "content": text}] if text else []

    def respond(self, text: str, calls: list[ToolCall]) -> Reply:
        if self.field is not None:
            content, error = self._step({self.field: text})
            return Reply([{"role": "user", "content": content}], self.done, [error] if error else [])
        if not calls:
            return Reply(done=True)
        messages, errors = [], []
        for c in calls:
            if c.error is not None or c.name != STEP:
                why = c.error or f"Tool {c.name} not found."
                content, error = str({"error": why}), f"{c.name or 'a call'}: {why}"
            else:
                content, error = self._step(c.arguments)
            messages.append({"role": "tool", "name": c.name, "content": content})
            errors += [error] if error else []
            if self.done:
                break
        return Reply(messages, self.done, errors)

    def final(self) -> dict:
        """{"url", "rewards": each step's, "reward": their sum (None left out), "done", "observation": the last}."""
        total = sum(r for r in self.rewards if r is not None)
        return dict(url=self.url, rewards=self.rewards, reward=total, done=self.done, observation=self.observation)

    def close(self) -> None:
        self.client.close()

    def _step(self, action: dict) -> tuple[str, str | None]:
        """(the observation's text, None), or (the server's error as the model sees it, its line) for an action it
        rejected; the step's reward and done recorded."""
        result = self._call("step", action)
        if isinstance(result, str):
            return str({"error": result}), f"{STEP}: {result}"
        self.rewards.append(result.reward)
        self.done, self.observation = bool(result.done), result.observation
        return observation_text(result.observation), None

    def _call(self, method: str, *args, **kwargs):
        """The client's reset or step; a server error about the action comes back as its text, anything else (no
        server, a session refused, no answer in time) is an EnvironmentFailure naming the server."""
        try:
            return getattr(self.client, method)(*args, **kwargs)
        except RuntimeError as e:  # the server answered with an error (EnvClient._send_and_receive)
            if any(f"(code: {code})" in str(e) for code in _MODEL_ERRORS):
                return str(e)
            raise EnvironmentFailure(
                at_capacity(self.url, method) or f"OpenEnv server {self.url}: {method} failed: {e}"
            )
        except Exception as e:  # noqa: BLE001 (connection refused or lost, timeouts: the server is gone)
            why = str(e) or (  # a timeout says nothing of itself
                f"no answer within {self.timeout_s:g}s (rollout.tool_timeout_s)"
                if isinstance(e, TimeoutError)
                else "no message"
            )
            said = f"OpenEnv server {self.url}: {method}: {type(e).__name__}: {why}"
            raise EnvironmentFailure(at_capacity(self.url, method) or said) from None


def action_schema(url: str) -> dict:
    """The server's action JSON schema (GET /schema); a server that does not answer fails naming it."""
    import requests

    http = url.replace("ws://", "http://", 1).replace("wss://", "https://", 1).rstrip("/")
    try:
        response = requests.get(f"{http}/schema", timeout=30)
    except requests.RequestException as e:  # refused, unreachable, timed out
        raise EnvironmentFailure(
            f"rollout.environment {url!r}: no OpenEnv server answers there ({type(e).__name__}); start it first"
        ) from None
    try:
        response.raise_for_status()
        return response.json()["action"]
    except (requests.RequestException, ValueError, KeyError, TypeError):
        raise EnvironmentFailure(
            f"rollout.environment {url!r}: GET /schema answered HTTP {response.status_code} without an action schema: "
            "is it an OpenEnv server (openenv-core's create_app)?"
        ) from None


def build(source: Source) -> Callable[[], OpenEnvEpisode]:
    """The factory of kind `openenv`: the server's action schema read once, a session per episode."""
    try:
        import openenv.core  # noqa: F401
    except ImportError:
        raise EnvironmentFailure(
            f"rollout.environment {source.environment!r} names an OpenEnv server, and openenv-core is not installed: "
            "pip install -e '.[agents]'"
        ) from None
    schema = action_schema(source.environment)
    field = text_field(schema)
    schemas = [] if field else [step_tool(schema)]
    return lambda: OpenEnvEpisode(source.environment, field, schemas, source.timeout_s)


SESSIONS = (("rollout", "chunk_prompts", "group_size"), ("eval", "n_prompts", "samples_per_prompt"))
"""Where a run opens OpenEnv sessions at once, one an episode: a chunk of the rollouts' prompts, each with its group,
and the held-out eval's prompts (stages/samples.py), (section, the prompts setting, the episodes-a-prompt setting)."""


def session_limit(url: str, need: int, timeout_s: float = 30.0) -> int | None:
    """The most sessions the OpenEnv server at `url` holds at once, learned by opening sessions as OpenEnv's client
    does (a WebSocket to /ws each) until it refuses one at capacity (its CAPACITY_REACHED error names max_sessions)
    or `need` are open; None: it held `need`. OpenEnv's /metadata does not say; the sessions are closed after."""
    from openenv.core.utils import convert_to_ws_url
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    opened = []
    try:
        while len(opened) < need:
            opened.append(connect(f"{convert_to_ws_url(url)}/ws", open_timeout=timeout_s, proxy=None))
            try:
                opened[-1].send(json.dumps({"type": "state"}))
            except ConnectionClosed:
                pass  # refused at once: its error, if it sent one, is still to read
            try:
                answer = json.loads(opened[-1].recv(timeout=timeout_s))
            except ConnectionClosed:
                return len(opened) - 1
            data = answer.get("data") or {}
            if answer.get("type") == "error" and data.get("code") == "CAPACITY_REACHED":
                return int(data.get("max_sessions", len(opened) - 1))
        return None
    finally:
        for ws in opened:
            ws.close()


def at_capacity(url: str, method: str) -> str | None:
    """The line for a session the server refused because it holds no more (asked again: at capacity now); None
    where it is not so (the failure was another)."""
    try:
        limit = session_limit(url, 1, timeout_s=5.0) if method == "reset" else None
    except Exception:  # noqa: BLE001 (the server is gone: the caller's line says so)
        return None
    if limit is None:
        return None
    return (
        f"OpenEnv server {url}: reset: the server is at capacity, {limit} sessions: more episodes are open at once "
        "than it holds (rollout.chunk_prompts x rollout.group_size; eval.n_prompts x eval.samples_per_prompt); "
        "lower those, or serve it with create_app(..., max_concurrent_envs=N)"
    )


def check_sessions(cfg) -> None:
    """`grpo init` of a run on an OpenEnv server (a RunConfig): refuse, in one line naming both numbers and the two
    settings, a config that opens more sessions at once (SESSIONS) than the server holds (session_limit)."""
    url, opens = cfg.rollout.environment, []
    if cfg.rollout.environment_kind() != "openenv":
        return
    for section, prompts, each in SESSIONS:
        n, g = getattr(getattr(cfg, section), prompts), getattr(getattr(cfg, section), each)
        n = min(n, cfg.rollout.prompts_per_iteration) if section == "rollout" else n  # a chunk is at most them all
        opens.append((n * g, f"{section}.{prompts} x {section}.{each} = {n} x {g}", f"{section}.{prompts}"))
    most = max(opens)
    limit = session_limit(url, most[0])
    if limit is None:
        return
    for need, product, lower in opens:
        if need > limit:
            raise ConfigError(
                f"rollout.environment {url!r}: the OpenEnv server holds at most {limit} sessions at once and the run "
                f"opens {need} ({product}, an episode each); lower {lower} so the product is at most {limit}, or "
                f"serve it with create_app(..., max_concurrent_envs={need})"
            )
