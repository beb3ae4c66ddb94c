"""A prompt as the model sees it: chat messages rendered by the model's chat template (with an episode's tools), or
text as it is; tokenized for the sampler. The observations an episode appends are rendered in chat.py beside it.
"""

from __future__ import annotations

from typing import Literal

from grpo.errors import DatasetError
from grpo.tasks import Example

PromptFormat = Literal["auto", "chat", "text"]


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def apply_template(tokenizer, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool) -> str:
    """The chat template's text of `messages`; `tools` rendered as apply_chat_template(tools=...) does ([] and None
    alike: some templates, Llama's, render tool instructions for an empty list)."""
    extra = {"tools": tools} if tools else {}
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt, **extra)


def chat_messages(prompt: str | list[dict], system_prompt: str | None) -> list[dict]:
    """A prompt as chat messages: a string is one user message; `system_prompt` goes first unless the messages start
    with a system message.

    >>> chat_messages("2 + 2 =", "Be brief.")
    [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': '2 + 2 ='}]
    """
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if system_prompt and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system_prompt}] + messages
    return messages


def render(
    tokenizer, prompt: str | list[dict], fmt: PromptFormat, system_prompt: str | None, tools: list[dict] | None = None
) -> tuple[str, bool]:
    """(prompt text the model sees, whether it came from the chat template).

    `auto`: messages go through the template, a string is used as is; `chat`: a string becomes
    one user message first; `text`: a string as is (messages are refused). `system_prompt`
    goes first as a system message in chat formats (unless the messages start with one).
    `tools` (an episode's tools, JSON schemas; [] for none): rendered by the template as
    `apply_chat_template(tools=...)` renders them, and a string under `auto` becomes a user message
    (an episode goes on in the chat template).
    """
    if tools is None and (fmt == "text" or (fmt == "auto" and isinstance(prompt, str))):
        if not isinstance(prompt, str):
            raise DatasetError("task.prompt_format is text, but a prompt is a list of chat messages; use auto or chat")
        return prompt, False
    if not has_chat_template(tokenizer):
        raise DatasetError(
            "the model's tokenizer has no chat template; use task.prompt_format=text or a model with one"
            + ("" if tools is None else " (episodes need one: rollout.tools, rollout.environment)")
        )
    messages = chat_messages(prompt, system_prompt)
    return apply_template(tokenizer, messages, tools, add_generation_prompt=True), True


def tokenize_prompts(
    tokenizer,
    examples: list[Example],
    fmt: PromptFormat,
    system_prompt: str | None,
    tools: list[dict] | None = None,
    limit: int | None = None,
) -> tuple[list[str], list[list[int] | None]]:
    """Rendered texts and token ids; a templated prompt carries its own special tokens. `tools`: render's. With
    `limit`, a text surely longer than `limit` tokens (surely_longer) is not tokenized, its ids None: three 10 MB
    prompts took 4.8 GB to tokenize before they were skipped."""
    rendered = [render(tokenizer, e.prompt, fmt, system_prompt, tools) for e in examples]
    texts = [t for t, _ in rendered]
    ids: list[list[int] | None] = [[] for _ in texts]
    skip = {i for i, t in enumerate(texts) if limit is not None and surely_longer(tokenizer, t, limit)}
    for i in skip:
        ids[i] = None
    for templated in (False, True):
        idx = [i for i, (_, t) in enumerate(rendered) if t == templated and i not in skip]
        if idx:
            enc = tokenizer([texts[i] for i in idx], add_special_tokens=not templated)["input_ids"]
            for i, row in zip(idx, enc):
                ids[i] = row
    return texts, ids


def surely_longer(tokenizer, text: str, limit: int) -> bool:
    """Whether `text` has more than `limit` tokens, told without tokenizing it: no token holds more characters than
    the vocabulary's longest entry, so a text of more than 4 x `limit` x that many characters other than spaces (4:
    room for normalizers that drop some) has more tokens. Only a text that long is asked the vocabulary."""
    if len(text) <= 4 * limit:
        return False
    longest = max(map(len, tokenizer.get_vocab()), default=1)
    return len(text) - sum(c.isspace() for c in text) > 4 * limit * longest
