"""Tool calls parsed from an assistant turn, in the format the model's chat template writes them.

One small parser a format, chosen once by `tool_format` from what the tokenizer is: its response template where it
has one (transformers' `response_template`, what `tokenizer.parse_response` reads), else the format its chat
template writes an assistant's tool call in (the template renders a probe call, and the first parser that reads the
probe back is the format):
  qwen      JSON `{"name": ..., "arguments": {...}}` in `<tool_call>...</tool_call>` (Qwen2.5, Qwen3, Hermes)
  qwen_xml  `<tool_call><function=NAME><parameter=P>value</parameter></function></tool_call>` (Qwen3.5, Qwen3-Coder)
  llama     the turn a JSON object `{"name": ..., "parameters": {...}}` (Llama 3.1, 3.2)
  mistral   `[TOOL_CALLS]` and a JSON list of calls, or `NAME[ARGS]{...}` a call (Mistral's tokenizers v3 and v11)
  harmony   GPT-OSS: messages on the analysis / commentary / final channels, a call one addressed to functions.NAME
A `<think>...</think>` block (Qwen3, Qwen3.5) goes to the message's `reasoning_content`, as Qwen3's template reads it.
A template that writes tool calls in no format here is refused at `grpo init` (`check_tool_format`). A template that
renders no tool calls at all is read as qwen.

A call that does not parse (bad JSON, no name, a block cut off by the token budget, any exception a parser raises on
what the model wrote) is still a call: ToolCall.error says why, and the adapter answers it with that error (the model
sees it). The text parsed is for reading the model's intent only; the tokens the learner trains on are the sampled
ones.
"""

from __future__ import annotations

import json
import re
from typing import Callable, Literal

from grpo.config import ConfigError
from grpo.episodes.chat import with_call_ids
from grpo.episodes.environment import ToolCall

Format = Literal["response_template", "qwen", "qwen_xml", "llama", "mistral", "harmony"]
Parsed = tuple[dict, list[ToolCall]]

TOOL_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.S)
THINK = re.compile(r"^\s*(?:<think>)?(.*?)</think>\s*", re.S)
FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(</function>|$)", re.S)
PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.S)
HARMONY = re.compile(r"(.*?)<\|message\|>(.*?)(<\|end\|>|<\|call\|>|<\|return\|>|$)", re.S)


def parse_turn(tokenizer, text: str, prefix: str, tools: list[dict], fmt: Format | None = None) -> Parsed:
    """(the turn as an assistant message the chat template renders back: content and the calls that parsed, its
    calls in order). `prefix`: the text before the turn (a response template reads the assistant's header there);
    `fmt`: the tokenizer's tool_format (found here when not given)."""
    fmt = fmt or tool_format(tokenizer) or "qwen"
    try:
        if fmt == "response_template":
            return _response_template(tokenizer, text, prefix, tools)
        return PARSERS[fmt](text, tools)
    except Exception as e:  # noqa: BLE001 (what the model wrote never fails the stage: ValueError of a 4300-digit
        # integer, RecursionError of a thousand nested brackets, anything else)
        return {"role": "assistant", "content": text}, [ToolCall("", {}, error=f"{type(e).__name__}: {_line(e)}")]


def _line(e: BaseException) -> str:
    return " ".join(str(e).split())[:300]


def _response_template(tokenizer, text: str, prefix: str, tools: list[dict]) -> Parsed:
    message = tokenizer.parse_response(text, prefix=prefix, tools=tools or None)
    calls = [_from_message(c) for c in message.get("tool_calls") or []]
    return {"role": "assistant", **message}, calls


def _from_message(call: dict) -> ToolCall:
    fn = call.get("function", call)
    name, arguments = fn.get("name"), fn.get("arguments", {})
    if not isinstance(name, str) or not isinstance(arguments, dict):
        return ToolCall(name if isinstance(name, str) else "", {}, error=f"no name and JSON object arguments: {fn}")
    return ToolCall(name, arguments)


def _message(content: str, calls: list[ToolCall], **extra) -> Parsed:
    """The assistant message of a turn: its content, the calls that parsed as tool_calls (a botched one is only
    in `calls`)."""
    message = {"role": "assistant", "content": content, **extra}
    parsed = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
    parsed = [p for p, c in zip(parsed, calls) if c.error is None]
    return (message | {"tool_calls": parsed} if parsed else message), calls


def split_think(text: str) -> tuple[str | None, str]:
    """(the reasoning of a `<think>` block the turn starts with, the rest); (None, text) without a closed one.

    >>> split_think("<think>\\nsix times seven\\n</think>\\n\\n42")
    ('six times seven', '42')
    >>> split_think("<think>cut off")
    (None, '<think>cut off')
    """
    m = THINK.match(text)
    return (m.group(1).strip("\n"), text[m.end() :]) if m else (None, text)


def _thinking(parse: Callable[[str, list[dict]], Parsed]) -> Callable[[str, list[dict]], Parsed]:
    """A parser that reads the calls after the turn's think block, which goes to reasoning_content."""

    def parser(text: str, tools: list[dict]) -> Parsed:
        reasoning, rest = split_think(text)
        message, calls = parse(rest, tools)
        return (message if reasoning is None else message | {"reasoning_content": reasoning}), calls

    return parser


def qwen_turn(text: str, tools: list[dict] | None = None) -> Parsed:
    """A turn in Qwen's format: (message, calls).

    >>> message, calls = qwen_turn('Let me multiply.<tool_call>{"name": "mul", "arguments": {"a": 2}}</tool_call>')
    >>> message["content"], calls
    ('Let me multiply.', [ToolCall(name='mul', arguments={'a': 2}, error=None)])
    >>> qwen_turn('<tool_call>{"name": "mul", "arguments": {"a"')[1][0].error
    'the <tool_call> is not closed (cut off?)'
    >>> qwen_turn("The answer is 6.")
    ({'role': 'assistant', 'content': 'The answer is 6.'}, [])
    """
    return _blocks(text, _qwen_call)


def _blocks(text: str, read: Callable[[str, str], ToolCall], tools: list[dict] | None = None) -> Parsed:
    """A turn whose calls are `<tool_call>` blocks, each read by `read(body, closing tag)`."""
    blocks = list(TOOL_CALL.finditer(text))
    calls = [read(m.group(1), m.group(2), *([tools] if tools is not None else [])) for m in blocks]
    content = text
    for m, c in reversed(list(zip(blocks, calls))):  # the calls that parsed leave the text; a botched one stays
        content = content[: m.start()] + content[m.end() :] if c.error is None else content
    return _message(content.strip(), calls)


def _qwen_call(body: str, closed: str) -> ToolCall:
    """One `<tool_call>` block's JSON call."""
    if not closed:
        return ToolCall("", {}, error="the <tool_call> is not closed (cut off?)")
    try:
        value = json.loads(body)
    except json.JSONDecodeError as e:
        return ToolCall("", {}, error=f"not JSON: {e}")
    return _json_call(value, body)


def _json_call(value: object, body: str) -> ToolCall:
    """A call written as a JSON object {"name", "arguments" (or "parameters")}."""
    if not isinstance(value, dict):
        return ToolCall("", {}, error=f"not a JSON object: {body.strip()[:200]}")
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    return _from_message({"name": value.get("name"), "arguments": arguments})


def qwen_xml_turn(text: str, tools: list[dict] | None = None) -> Parsed:
    """A turn in Qwen3.5's and Qwen3-Coder's XML format; a value is read as its tool schema types the parameter
    (else as JSON where it is JSON, else as text), as vLLM's qwen3_coder parser reads it.

    >>> qwen_xml_turn("Sure.\\n<tool_call>\\n<function=mul>\\n<parameter=a>\\n6\\n</parameter>\\n"
    ...               "<parameter=note>\\nsix times\\n</parameter>\\n</function>\\n</tool_call>")[1]
    [ToolCall(name='mul', arguments={'a': 6, 'note': 'six times'}, error=None)]
    """
    return _blocks(text, _xml_call, tools or [])


def _xml_call(body: str, closed: str, tools: list[dict]) -> ToolCall:
    if not closed:
        return ToolCall("", {}, error="the <tool_call> is not closed (cut off?)")
    fn = FUNCTION.search(body)
    if fn is None or not fn.group(3):
        return ToolCall("", {}, error=f"no closed <function=NAME> in the <tool_call>: {body.strip()[:200]}")
    name = fn.group(1).strip()
    types = _parameter_types(tools, name)
    arguments = {}
    for p in PARAMETER.finditer(fn.group(2)):
        value = p.group(2).removeprefix("\n").removesuffix("\n")
        arguments[p.group(1).strip()] = _typed(value, types.get(p.group(1).strip()))
    return ToolCall(name, arguments)


def _parameter_types(tools: list[dict], name: str) -> dict[str, str]:
    for t in tools:
        fn = t.get("function", t)
        if fn.get("name") == name:
            return {k: v.get("type") for k, v in (fn.get("parameters") or {}).get("properties", {}).items()}
    return {}


def _typed(value: str, kind: str | None) -> object:
    """A parameter's text as its schema's type: string stays text, the rest (and an untyped one) JSON where it
    parses."""
    if kind == "string":
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def llama_turn(text: str, tools: list[dict] | None = None) -> Parsed:
    """A turn in Llama 3.1's and 3.2's JSON format: the turn (after an optional `<|python_tag|>`) is a call, or
    several joined by `;`; a turn that does not start with `{` is text.

    >>> llama_turn('{"name": "mul", "parameters": {"a": 6, "b": 7}}')[1]
    [ToolCall(name='mul', arguments={'a': 6, 'b': 7}, error=None)]
    >>> llama_turn('{"name": "mul", "parameters": {"a": 6')[1][0].error[:8]
    'not JSON'
    """
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return _message(text.strip(), [])
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(body):
        try:
            value, end = decoder.raw_decode(body, at)
        except json.JSONDecodeError as e:
            return _message(text.strip(), calls + [ToolCall("", {}, error=f"not JSON: {e}")])
        calls.append(_json_call(value, body[at:end]))
        at = end + len(body[end:]) - len(body[end:].lstrip().removeprefix(";").lstrip())
    return _message("" if any(c.error is None for c in calls) else text.strip(), calls)  # a botched call stays


def mistral_turn(text: str, tools: list[dict] | None = None) -> Parsed:
    """A turn in Mistral's format: its text, then `[TOOL_CALLS]` and a JSON list of {name, arguments} (tokenizer
    v3), or `[TOOL_CALLS]NAME[ARGS]{...}` for each call (v11 and later).

    >>> mistral_turn('[TOOL_CALLS][{"name": "mul", "arguments": {"a": 6}, "id": "a1b2c3d4e"}]')[1]
    [ToolCall(name='mul', arguments={'a': 6}, error=None)]
    >>> mistral_turn('[TOOL_CALLS]mul[ARGS]{"a": 6}')[1]
    [ToolCall(name='mul', arguments={'a': 6}, error=None)]
    """
    content, _, rest = text.partition("[TOOL_CALLS]")
    if not _:
        return _message(text.strip(), [])
    if rest.lstrip().startswith("["):
        try:
            values = json.loads(rest)
        except json.JSONDecodeError as e:
            return _message(content.strip(), [ToolCall("", {}, error=f"not JSON: {e}")])
        values = values if isinstance(values, list) else [values]
        calls = [_json_call(v, rest) for v in values]
        message, calls = _message(content.strip(), calls)
        ids = [v.get("id") for v, c in zip(values, calls) if c.error is None]  # the model's ids, rendered back
        for c, i in zip(message.get("tool_calls", []), ids):
            c.update({"id": i} if isinstance(i, str) else {})
        return message, calls
    calls = []
    for part in rest.split("[TOOL_CALLS]"):
        name, sep, arguments = part.partition("[ARGS]")
        if not sep:
            calls.append(ToolCall("", {}, error=f"no [ARGS] after the tool's name: {part[:200]}"))
            continue
        try:
            value = {"name": name.split("[CALL_ID]")[0].strip(), "arguments": json.loads(arguments)}
            calls.append(_json_call(value, part))
        except json.JSONDecodeError as e:
            calls.append(ToolCall("", {}, error=f"not JSON: {e}"))
    return _message(content.strip(), calls)


def harmony_turn(text: str, tools: list[dict] | None = None) -> Parsed:
    """A turn in GPT-OSS's harmony format (what follows the `<|start|>assistant` header): messages, each a header
    naming its channel and, for a call, its recipient `to=functions.NAME`, then `<|message|>` and the body. The
    analysis channel is the message's `thinking`, the final channel its content, a call's body its JSON arguments.

    >>> harmony_turn('<|channel|>analysis<|message|>Multiply.<|end|><|start|>assistant to=functions.mul'
    ...              '<|channel|>commentary json<|message|>{"a": 6}')[1]
    [ToolCall(name='mul', arguments={'a': 6}, error=None)]
    >>> harmony_turn('<|channel|>final<|message|>42')[0]
    {'role': 'assistant', 'content': '42'}
    """
    thinking, final, calls = [], [], []
    for m in HARMONY.finditer(text.replace("<|start|>assistant", "")):
        header, body = m.group(1), m.group(2)
        recipient = re.search(r"to=(\S+?)(?=<\||\s|$)", header)
        channel = re.search(r"<\|channel\|>(\w+)", header)
        if recipient is not None and recipient.group(1).startswith("functions."):
            try:
                arguments = json.loads(body)
            except json.JSONDecodeError as e:
                calls.append(ToolCall("", {}, error=f"not JSON: {e}"))
                continue
            calls.append(_from_message({"name": recipient.group(1).removeprefix("functions."), "arguments": arguments}))
        elif channel is not None and channel.group(1) == "analysis":
            thinking.append(body)
        else:
            final.append(body)
    extra = {"thinking": "\n".join(thinking)} if thinking else {}
    if not (thinking or final or calls):
        return _message(text, [])
    return _message("" if calls and thinking else "\n".join(final), calls, **extra)


PARSERS: dict[str, Callable[[str, list[dict]], Parsed]] = {
    "qwen": _thinking(qwen_turn),
    "qwen_xml": _thinking(qwen_xml_turn),
    "llama": llama_turn,
    "mistral": mistral_turn,
    "harmony": harmony_turn,
}
"""The formats a chat template's tool calls are read in, tried in this order on the template's probe call."""

PROBE = {"name": "grpo_probe", "arguments": {"n": 1, "word": "two"}}
"""The call a chat template renders so its format can be told (`rendered_turn`)."""


def rendered_turn(tokenizer, message: dict) -> str:
    """The text of an assistant `message` as the chat template writes it after the assistant's header: what a
    model of that template samples for it, its end-of-turn token dropped (the special tokens the text ends with)."""
    user = [{"role": "user", "content": "x"}]
    before = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=False)
    header = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)[len(before) :]
    text = tokenizer.apply_chat_template(user + [message], tokenize=False, add_generation_prompt=False)
    text = text[len(before) :] if text.startswith(before) else text
    text = text[len(header) :] if text.startswith(header) else text
    ends = tokenizer.all_special_tokens
    text = text.rstrip()
    while any(e and text.endswith(e) for e in ends):
        text = text[: -len(next(e for e in ends if e and text.endswith(e)))].rstrip()
    return text


def tool_format(tokenizer) -> Format | None:
    """The format the tokenizer's tool calls are read in: `response_template` where it has one, else the first
    parser that reads back the probe call its chat template renders; qwen for a template that renders no calls;
    None where the template writes calls no parser reads (`check_tool_format` says how)."""
    if getattr(tokenizer, "response_template", None) is not None:
        return "response_template"
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return "qwen"
    key = (repr(template), tuple(tokenizer.all_special_tokens))
    if key not in _FOUND:
        _FOUND[key] = _probed(tokenizer)
    return _FOUND[key]


_FOUND: dict[tuple, Format | None] = {}  # (template, special tokens): its format, told once a process


def _probed(tokenizer) -> Format | None:
    """The format whose parser reads back the probe call the chat template renders."""
    probe = {"role": "assistant", "content": "", "tool_calls": [_probe_call()]}
    try:
        text = rendered_turn(tokenizer, probe)
    except Exception:  # noqa: BLE001 (a template that cannot render a call: read as qwen, the one format once)
        return "qwen"
    if PROBE["name"] not in text:
        return "qwen"
    expected = [ToolCall(PROBE["name"], PROBE["arguments"])]
    for name, parse in PARSERS.items():
        try:
            if parse(text, [])[1] == expected:
                return name  # type: ignore[return-value]
        except Exception:  # noqa: BLE001
            continue
    return None


def _probe_call() -> dict:
    return {"type": "function", "id": "a1b2c3d4e", "function": dict(PROBE)}


def check_tool_format(tokenizer, where: str, tools: list[dict]) -> None:
    """Refuse (ConfigError, one line starting with `where`) a tokenizer whose chat template writes tool calls in a
    format no parser here reads, showing how it writes one, or cannot render a tool's answer to a call as the
    episodes write it (chat.with_call_ids). Episodes without tools (an OpenEnv server stepped with the turn's text)
    call nothing: any template does."""
    if not tools:
        return
    probe = {"role": "assistant", "content": "", "tool_calls": [_probe_call()]}
    if tool_format(tokenizer) is None:
        raise ConfigError(
            f"{where}: the model's chat template writes a tool call as {rendered_turn(tokenizer, probe)[:160]!r}, a "
            f"format grpo does not parse (it reads {', '.join(PARSERS)}, or the tokenizer's response_template); give "
            "the tokenizer a response_template for it, or a chat template in one of those formats"
        )
    answer = {"role": "tool", "name": PROBE["name"], "content": "1"}  # as grpo/episodes/calls.py writes one
    try:
        conversation = with_call_ids([{"role": "user", "content": "x"}, probe, answer])
        tokenizer.apply_chat_template(conversation, tools=tools, tokenize=False)
    except Exception as e:  # noqa: BLE001 (jinja errors of the model's template)
        raise ConfigError(
            f"{where}: the model's chat template does not render a tool's answer as episodes write it ({_line(e)}); "
            "give the tokenizer a chat template that renders tool messages {role: tool, name, content}"
        ) from e
