"""The chat template's tokens of an episode: its prompt with the tools rendered in, and each observation's ids.

Token in, token out. An episode's tokens are the prompt's ids, then each sampled turn's ids as the sampler gave them,
each followed by the ids of what the environment answered. Those are rendered here as a delta: the template renders
the conversation up to the sampled turn, and again with the new messages and the next assistant header; the text
the second adds after the turn's end-of-turn token is tokenized alone and appended. Nothing already appended is
decoded and encoded again (the learner trains on the ids the sampler produced, as TRL's tool loop builds its ids;
TRL #5224 is what re-tokenizing costs). A template whose render of the conversation so far changes once more
messages follow (not prefix-preserving) cannot be continued this way, and is refused in one line naming it; the one
change allowed is reasoning the template drops from earlier turns (Qwen3's think blocks: the ids keep them).

What a tool or an environment says is text: a special token's text in an observation (a forged `<|im_end|>` and a
user turn after it) is encoded as plain text, so it never becomes a turn boundary; only the template's own text
around it is read with the tokenizer's special tokens. Tool calls and answers are rendered with ids (the model's own,
else given in order: with_call_ids) for templates that render them, as Mistral's does.
"""

from __future__ import annotations

import copy
import re

from grpo.config import ConfigError
from grpo.episodes.templates import apply_template
from grpo.errors import StageError

THINK_BLOCK = re.compile(r"<think>.*?</think>\s*", re.S)
THINKING = "{{%- set enable_thinking = {} %}}"


def with_thinking(tokenizer, enable_thinking: bool | None):
    """The tokenizer whose chat template renders with `enable_thinking` set (task.enable_thinking; Qwen3's switch:
    off, its generation prompt carries an empty think block), the tokenizer itself when None: a copy whose template
    sets the variable first, so every render of the prompts and episodes sees the one setting. A template that does
    not read the variable is refused in one line (ConfigError naming the setting).

    >>> from grpo.tiny_model import build_chat_tokenizer
    >>> tok = build_chat_tokenizer(["x"], 300, "{{ 'off' if enable_thinking is defined and not enable_thinking }}")
    >>> user = [{"role": "user", "content": ""}]
    >>> [with_thinking(tok, v).apply_chat_template(user, tokenize=False) for v in (None, False)]
    ['', 'off']
    """
    if enable_thinking is None:
        return tokenizer
    if not reads_thinking(tokenizer):
        raise ConfigError(
            f"task.enable_thinking={enable_thinking}: the model's chat template does not read enable_thinking (it "
            "has no thinking switch); unset task.enable_thinking"
        )
    setting = THINKING.format("true" if enable_thinking else "false")
    template = tokenizer.chat_template
    copied = copy.copy(tokenizer)
    copied.chat_template = (
        _set(setting, template) if isinstance(template, str) else {k: _set(setting, v) for k, v in template.items()}
    )
    return copied


def _set(setting: str, template: str) -> str:
    """`template` with `setting` first (in place of one set before)."""
    for was in (THINKING.format("true"), THINKING.format("false")):
        template = template.removeprefix(was)
    return setting + template


def reads_thinking(tokenizer) -> bool:
    """Whether the tokenizer's chat template reads `enable_thinking`."""
    template = tokenizer.chat_template or ""
    return "enable_thinking" in (template if isinstance(template, str) else "".join(template.values()))


def with_reset(prompt: list[dict], added: list[dict]) -> list[dict]:
    """The prompt's messages with what an environment's reset adds: a user message right after the prompt's last
    user message is joined to it (its text appended, as TRL appends what `reset` returns), the rest follow.

    >>> with_reset([{"role": "user", "content": "Play."}], [{"role": "user", "content": " Board: x.o"}])
    [{'role': 'user', 'content': 'Play. Board: x.o'}]
    """
    if added and prompt and prompt[-1]["role"] == added[0]["role"] == "user":
        joined = {**prompt[-1], "content": prompt[-1]["content"] + added[0]["content"]}
        return prompt[:-1] + [joined] + list(added[1:])
    return list(prompt) + list(added)


def prompt_tokens(tokenizer, messages: list[dict], tools: list[dict]) -> tuple[str, list[int]]:
    """(text, ids) of a prompt with its tools and the assistant's header (the ids carry the template's own special
    tokens: none added)."""
    text = apply_template(tokenizer, messages, tools, add_generation_prompt=True)
    return text, tokenizer(text, add_special_tokens=False)["input_ids"]


def observation_tokens(
    tokenizer, history: list[dict], new: list[dict], tools: list[dict], ended: str | None, turn_ends: list[str]
) -> tuple[str, list[int]]:
    """(text, ids) appended after a sampled turn for the messages `new` and the next assistant header.

    history: the conversation up to and with the sampled turn (parsed back into an assistant message); ended: the text
    of the end-of-turn token the turn's ids end with, None when it ended without one (a stop string), when the delta
    starts with the template's own end of the turn; turn_ends: the texts of every end-of-turn token (the checkpoint's
    eos ids), where the template closes an assistant turn. What the messages say is text: a special token's text in
    it (a tool answering `<|im_end|>`) is encoded as plain text, never as the template's own token.
    """
    both = with_call_ids(history + new)
    history, new = both[: len(history)], both[len(history) :]
    before = apply_template(tokenizer, history, tools, add_generation_prompt=False)
    after = apply_template(tokenizer, history + new, tools, add_generation_prompt=True)
    forged = _forged(tokenizer, new)
    slots = _content_slots(tokenizer, history, new, tools, after) if forged or not after.startswith(before) else []
    if after.startswith(before):
        closing, start = _closing(before, turn_ends), len(before)
    else:
        closing, start = _rewritten_closing(before, after, slots, turn_ends), -1
    if closing >= 0:
        start = closing + (len(ended) if ended is not None and after.startswith(ended, closing) else 0)
    # a template that ends assistant turns with no token we know: append after all of it (start = len(before))
    text = after[start:]
    if not forged:
        return text, tokenizer(text, add_special_tokens=False)["input_ids"]
    spans = [(a - start, b - start) for a, b in slots if a >= start] or _found(text, new)
    return text, _as_text_inside(tokenizer, text, spans)


def _found(text: str, new: list[dict]) -> list[tuple[int, int]]:
    """[(start, end)] of every place a text of the new messages is found as it is in `text`, in order (where the
    template's render of them could not be told apart by _content_slots: what may be the answer is read as text)."""
    spans = []
    for said in {said for m in new for said in _texts(m) if said}:
        at = text.find(said)
        while at >= 0:
            spans.append((at, at + len(said)))
            at = text.find(said, at + len(said))
    merged: list[tuple[int, int]] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(b, merged[-1][1]))
        else:
            merged.append((a, b))
    return merged


def with_call_ids(messages: list[dict]) -> list[dict]:
    """The messages with an id on each tool call that has none and, on each tool answer without one, the id of the
    call it answers (the calls of the last assistant turn, answered in order, as grpo/episodes/calls.py answers
    them): Mistral's template renders both, and asks for 9 letters and digits.

    >>> m = with_call_ids([{"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}, {"role": "tool"}])
    >>> m[0]["tool_calls"][0]["id"], m[1]["tool_call_id"]
    ('call00000', 'call00000')
    """
    out, pending, k = [], [], 0
    for m in messages:
        if m.get("role") == "assistant" and m.get("tool_calls"):
            calls = [c if c.get("id") else c | {"id": f"call{k + j:05d}"} for j, c in enumerate(m["tool_calls"])]
            k, pending, m = k + len(calls), [c["id"] for c in calls], m | {"tool_calls": calls}
        elif m.get("role") == "tool" and not m.get("tool_call_id") and pending:
            m = m | {"tool_call_id": pending.pop(0)}
        out.append(m)
    return out


def _closing(before: str, turn_ends: list[str]) -> int:
    """Where the last end-of-turn token of `before` starts (-1: none)."""
    return max((before.rfind(t) for t in turn_ends), default=-1)


def _rewritten_closing(before: str, after: str, slots: list[tuple[int, int]], turn_ends: list[str]) -> int:
    """Where the sampled turn's end-of-turn token is in `after`, when the template rendered the conversation so far
    otherwise once messages follow: allowed only where all it changed is reasoning it drops (Qwen3's template
    strips an earlier turn's think block; the sampled ids keep it, token in, token out), refused in one line else."""
    region = after[: slots[0][0]] if slots else ""
    closing = _closing(region, turn_ends)
    said = _closing(before, turn_ends)
    if closing < 0 or said < 0 or _without_reasoning(before[:said]) != _without_reasoning(after[:closing]):
        raise StageError(
            "the model's chat template renders the conversation so far otherwise once a tool or observation message "
            f"follows (it is not prefix-preserving: {_first_difference(before, after)}), so an episode cannot go on "
            "from the tokens it sampled; give the tokenizer a template that keeps earlier turns as they were"
        )
    return closing


def _without_reasoning(text: str) -> str:
    """The text without its think blocks (the reasoning a template may drop from earlier turns).

    >>> _without_reasoning("<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\nhi")
    '<|im_start|>assistant\\nhi'
    """
    return THINK_BLOCK.sub("", text)


def _special_texts(tokenizer) -> list[str]:
    """The texts the tokenizer reads as one added token (special tokens and the rest of its added vocabulary)."""
    return [t for t in tokenizer.get_added_vocab() if t]


def _forged(tokenizer, new: list[dict]) -> bool:
    """Whether a new message's text holds a token's text the tokenizer would read as its own added token."""
    texts = _special_texts(tokenizer)
    return any(any(t in said for t in texts) for m in new for said in _texts(m))


def _texts(message: dict) -> list[str]:
    """A message's texts: its content, or the text of each of its content blocks."""
    content = message.get("content")
    if isinstance(content, str):
        return [content]
    blocks = content if isinstance(content, list) else []
    return [b["text"] for b in blocks if isinstance(b, dict) and isinstance(b.get("text"), str)]


def _with_texts(message: dict, texts: list[str]) -> dict:
    """The message with its texts (as _texts lists them) replaced by `texts`."""
    if isinstance(message.get("content"), str):
        return message | {"content": texts[0]}
    given, blocks = iter(texts), []
    for b in message.get("content") or []:
        blocks.append(b | {"text": next(given)} if isinstance(b, dict) and isinstance(b.get("text"), str) else b)
    return message | {"content": blocks}


MARK = "\u27e6grpo{}\u27e7"
"""What stands for a message's text when the template is rendered to find where that text goes (printable, so a
template that writes a list's repr or JSON keeps it as it is)."""


def _content_slots(tokenizer, history: list[dict], new: list[dict], tools: list[dict], after: str):
    """[(start, end)] in `after` of each text of the new messages as the template rendered it (in order); [] where
    the template does not show a text apart from the rest (then nothing is told apart)."""
    texts = [_texts(m) for m in new]
    marks = [[MARK.format(f"{i}.{j}") for j in range(len(t))] for i, t in enumerate(texts)]
    marked = [_with_texts(m, k) for m, k in zip(new, marks)]
    base = apply_template(tokenizer, history + marked, tools, add_generation_prompt=True)
    found = []
    for i, j in [(i, j) for i, t in enumerate(texts) for j in range(len(t))]:
        mark = marks[i][j]
        if base.count(mark) != 1:
            return []
        one = list(marked)
        one[i] = _with_texts(new[i], marks[i][:j] + [texts[i][j]] + marks[i][j + 1 :])
        one_text = apply_template(tokenizer, history + one, tools, add_generation_prompt=True)
        at, length = base.index(mark), len(one_text) - len(base) + len(mark)
        if one_text[:at] != base[:at] or one_text[at + length :] != base[at + len(mark) :]:
            return []
        found.append((at, length, len(mark)))
    slots, shift = [], 0
    for at, length, marked_length in sorted(found):
        slots.append((at + shift, at + shift + length))
        shift += length - marked_length
    return slots if len(base) + shift == len(after) else []


def _as_text_inside(tokenizer, text: str, slots: list[tuple[int, int]]) -> list[int]:
    """The ids of `text`, each slot's text encoded as plain text (a special token's text there split into ordinary
    tokens), the template's own text around them as the tokenizer reads it."""
    ids, at = [], 0
    for a, b in slots:
        ids += tokenizer(text[at:a], add_special_tokens=False)["input_ids"] if a > at else []
        ids += tokenizer(text[a:b], add_special_tokens=False, split_special_tokens=True)["input_ids"] if b > a else []
        at = b
    ids += tokenizer(text[at:], add_special_tokens=False)["input_ids"] if at < len(text) else []
    return ids


def _first_difference(a: str, b: str) -> str:
    at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"at character {at}, {a[max(0, at - 20) : at + 20]!r} became {b[max(0, at - 20) : at + 20]!r}"
