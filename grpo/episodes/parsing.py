"""Tool calls parsed from an assistant turn, as the model's chat template defines them.

Where the tokenizer has a response template (transformers' `response_template`, what `tokenizer.parse_response`
reads: the model's own format, reasoning and tool calls included), it parses the turn. Otherwise the turn is read in
the format of Qwen2.5, Qwen3 and Hermes-style templates: each call a JSON object `{"name": ..., "arguments": {...}}`
inside `<tool_call>...</tool_call>`. A call that does not parse (bad JSON, no name, a block cut off by the token
budget) is still a call: ToolCall.error says why, and the adapter answers it with that error (the model sees it).
The text parsed is for reading the model's intent only; the tokens the learner trains on are the sampled ones.
"""

from __future__ import annotations

import json
import re

from grpo.episodes.environment import ToolCall

TOOL_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.S)


def parse_turn(tokenizer, text: str, prefix: str, tools: list[dict]) -> tuple[dict, list[ToolCall]]:
    """(the turn as an assistant message the chat template renders back: content and the calls that parsed, its
    calls in order). `prefix`: the text before the turn (a response template reads the assistant's header there)."""
    if getattr(tokenizer, "response_template", None) is not None:
        try:
            message = tokenizer.parse_response(text, prefix=prefix, tools=tools or None)
        except ValueError as e:
            return {"role": "assistant", "content": text}, [ToolCall("", {}, error=" ".join(str(e).split()))]
        calls = [_from_message(c) for c in message.get("tool_calls") or []]
        return {"role": "assistant", **message}, calls
    return qwen_turn(text)


def _from_message(call: dict) -> ToolCall:
    fn = call.get("function", call)
    name, arguments = fn.get("name"), fn.get("arguments", {})
    if not isinstance(name, str) or not isinstance(arguments, dict):
        return ToolCall(name if isinstance(name, str) else "", {}, error=f"no name and JSON object arguments: {fn}")
    return ToolCall(name, arguments)


def qwen_turn(text: str) -> tuple[dict, list[ToolCall]]:
    """A turn in Qwen's format: (message, calls).

    >>> message, calls = qwen_turn('Let me multiply.<tool_call>{"name": "mul", "arguments": {"a": 2}}</tool_call>')
    >>> message["content"], calls
    ('Let me multiply.', [ToolCall(name='mul', arguments={'a': 2}, error=None)])
    >>> qwen_turn('<tool_call>{"name": "mul", "arguments": {"a"')[1][0].error
    'the <tool_call> is not closed (cut off?)'
    >>> qwen_turn("The answer is 6.")
    ({'role': 'assistant', 'content': 'The answer is 6.'}, [])
    """
    blocks = list(TOOL_CALL.finditer(text))
    calls = [_qwen_call(m.group(1), m.group(2)) for m in blocks]
    content = text
    for m, c in reversed(list(zip(blocks, calls))):  # the calls that parsed leave the text; a botched one stays
        content = content[: m.start()] + content[m.end() :] if c.error is None else content
    message = {"role": "assistant", "content": content.strip()}
    parsed = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
    parsed = [p for p, c in zip(parsed, calls) if c.error is None]
    return (message | {"tool_calls": parsed} if parsed else message), calls


def _qwen_call(body: str, closed: str) -> ToolCall:
    """One `<tool_call>` block's call."""
    if not closed:
        return ToolCall("", {}, error="the <tool_call> is not closed (cut off?)")
    try:
        value = json.loads(body)
    except json.JSONDecodeError as e:
        return ToolCall("", {}, error=f"not JSON: {e}")
    if not isinstance(value, dict):
        return ToolCall("", {}, error=f"not a JSON object: {body.strip()[:200]}")
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    return _from_message({"name": value.get("name"), "arguments": arguments})
