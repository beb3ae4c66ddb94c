"""A written conversation (a warm start's: TRL's `messages`) as an episode's tokens: the prompt's ids, then each
assistant turn's ids with loss mask 1 and what follows it (tool results, user turns) with loss mask 0, appended as the
episode loop appends them (chat.observation_tokens: the template's delta, never the whole text again; Episode.append:
the one place a loss mask is born). A conversation the learner warm-starts on is so tokenized as the episodes the RL
iterations sample: the same ids for the same turns, the same mask.
"""

from __future__ import annotations

from grpo.episodes.chat import observation_tokens, prompt_tokens
from grpo.episodes.records import Episode
from grpo.episodes.templates import apply_template
from grpo.errors import DatasetError

WARM_START = (-1, "")
"""The policy version (and hash) a written conversation's tokens are stamped with: before iteration 0's."""


def conversation_episode(
    tokenizer, messages: list[dict], tools: list[dict], turn_ends: list[str], where: str = "a conversation"
) -> Episode:
    """The episode of `messages` (chat messages, the assistant's turns among them); `turn_ends`: the texts of the
    checkpoint's end-of-turn tokens. Messages after the last assistant turn teach nothing and are left out. A
    conversation without an assistant turn, or one opening with it, is refused in one line naming `where`."""
    first = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), None)
    if first is None:
        raise DatasetError(f"{where}: no assistant message to train on")
    if first == 0:
        raise DatasetError(f"{where}: opens with an assistant message; a conversation opens with a system or user one")
    text, ids = prompt_tokens(tokenizer, messages[:first], tools)
    e = Episode(0, 0, None, prompt_text=text, prompt_ids=ids, messages=list(messages[:first]), prompt_messages=first)
    i = first
    while True:
        ended = _assistant_turn(tokenizer, e, messages[i], tools, turn_ends, where)
        following = next((j for j in range(i + 1, len(messages)) if messages[j].get("role") == "assistant"), None)
        if following is None:
            return e
        new = list(messages[i + 1 : following])
        _, observed = observation_tokens(tokenizer, e.messages, new, tools, ended, turn_ends)
        e.append(observed, False, None, WARM_START)
        e.messages += new
        i = following


def _assistant_turn(tokenizer, e: Episode, message: dict, tools: list[dict], turn_ends: list[str], where: str):
    """Append the ids of assistant `message` as a sampler would have produced them after e's tokens: the template's
    text of the turn up to and with its end-of-turn token. Returns that token's text (None: the template closes
    the turn with none of them)."""
    before = apply_template(tokenizer, e.messages, tools, add_generation_prompt=True)
    after = apply_template(tokenizer, e.messages + [message], tools, add_generation_prompt=False)
    if not after.startswith(before):
        raise DatasetError(
            f"{where}: the chat template renders an assistant turn otherwise than after its generation prompt (not "
            "prefix-preserving), so its tokens are not those a sampler would produce; give the tokenizer a template "
            "that keeps earlier turns as they were"
        )
    turn = after[len(before) :]
    found = [(turn.find(t), t) for t in turn_ends if turn.find(t) >= 0]
    ended = min(found)[1] if found else None
    if found:
        turn = turn[: min(found)[0] + len(ended)]
    ids = tokenizer(turn, add_special_tokens=False)["input_ids"]
    e.append(ids, True, [0.0] * len(ids), WARM_START)
    e.messages.append(message)
    return ended
