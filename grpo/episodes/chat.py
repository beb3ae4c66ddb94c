"""The chat template's tokens of an episode: its prompt with the tools rendered in, and each observation's ids.

Token in, token out. An episode's tokens are the prompt's ids, then each sampled turn's ids as the sampler gave them,
each followed by the ids of what the environment answered. Those are rendered here as a delta: the template renders
the conversation up to the sampled turn, and again with the new messages and the next assistant header; the text
the second adds after the turn's end-of-turn token is tokenized alone and appended. Nothing already appended is
decoded and encoded again (the learner trains on the ids the sampler produced, as TRL's tool loop builds its ids;
TRL #5224 is what re-tokenizing costs). A template whose render of the conversation so far changes once more
messages follow (not prefix-preserving) cannot be continued this way, and is refused in one line naming it.
"""

from __future__ import annotations

from grpo.data import apply_template
from grpo.errors import StageError


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
    eos ids), where the template closes an assistant turn.
    """
    before = apply_template(tokenizer, history, tools, add_generation_prompt=False)
    after = apply_template(tokenizer, history + new, tools, add_generation_prompt=True)
    if not after.startswith(before):
        raise StageError(
            "the model's chat template renders the conversation so far otherwise once a tool or observation message "
            f"follows (it is not prefix-preserving: {_first_difference(before, after)}), so an episode cannot go on "
            "from the tokens it sampled; give the tokenizer a template that keeps earlier turns as they were"
        )
    closing = max((before.rfind(t) for t in turn_ends), default=-1)
    if closing < 0:
        start = len(before)  # the template ends assistant turns with no token we know: append after all of it
    else:
        start = closing + (len(ended) if ended is not None and before.startswith(ended, closing) else 0)
    text = after[start:]
    return text, tokenizer(text, add_special_tokens=False)["input_ids"]


def _first_difference(a: str, b: str) -> str:
    at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"at character {at}, {a[max(0, at - 20) : at + 20]!r} became {b[max(0, at - 20) : at + 20]!r}"
