"""What a judge (reward.judge) is asked and how its answer is read: pure text in, text or numbers out.

A rubric judge writes, for each criterion in order, `REASON <name>: <why>` and then `VERDICT <name>: <verdict>`: the
reason comes before the verdict it explains. A ranking judge (RULER's form) may write `REASON <i>: <why>` lines, then
`RANKING: i, j, ...`, the group's responses (numbered from 1) best first. An answer that does not hold that form
parses to an error string, never an exception: the caller gives it reward.judge.parse_error_reward.
"""

from __future__ import annotations

import hashlib
import json
import re

RUBRIC_TEMPLATE = """You grade a response to a prompt.

Prompt:
{prompt}

Response:
{response}

Criteria:
{criteria}

For each criterion, in order, write a line `REASON <name>: <why>`, then a line `VERDICT <name>: <verdict>`, the \
verdict one of: {verdicts}."""

RANKING_TEMPLATE = """You rank {n} responses to one prompt, best first.

Prompt:
{prompt}

Responses:
{responses}

For each response write a line `REASON <number>: <why>`, then one line `RANKING: <numbers>`, every response's \
number once, best first, separated by commas."""

DEFAULT_TEMPLATES = {"rubric": RUBRIC_TEMPLATE, "ranking": RANKING_TEMPLATE}
"""Each mode's prompt where reward.judge.template is None (grpo.config.JUDGE_PLACEHOLDERS: what they fill)."""


def rubric_prompt(
    template: str | None, criteria: list[dict], verdicts: list[str], prompt: str, response: str, reference: str = ""
) -> str:
    """The rubric judge's message for one response; `reference` (the row's ground truth) fills {reference} where the
    template holds it (reference-guided judging) and is not in the message otherwise.

    >>> print(rubric_prompt("{criteria}|{verdicts}|{prompt}|{response}", [{"name": "ok", "description": "d"}],
    ...                     ["no", "yes"], "p", "r", "1 2"))
    - ok (weight 1): d|no, yes|p|r
    >>> print(rubric_prompt("{criteria}|{verdicts}|{prompt}|{response}|{reference}", [{"name": "ok"}], ["no"], "p",
    ...                     "r", "1 2"))
    - ok (weight 1): |no|p|r|1 2
    """
    listed = "\n".join(f"- {c['name']} (weight {c.get('weight', 1.0):g}): {c.get('description', '')}" for c in criteria)
    fill = {"prompt": prompt, "response": response, "criteria": listed, "verdicts": ", ".join(verdicts)}
    return (template or RUBRIC_TEMPLATE).format(**fill, reference=reference)


def ranking_prompt(template: str | None, prompt: str, responses: list[str], reference: str = "") -> str:
    """The ranking judge's message for one group; `reference` (the group's ground truth, one per prompt) fills
    {reference} where the template holds it.

    >>> print(ranking_prompt("{n}|{prompt}|{responses}|{reference}", "p", ["a", "b"], "a"))
    2|p|[1]
    a
    [2]
    b|a
    """
    listed = "\n".join(f"[{i}]\n{r}" for i, r in enumerate(responses, 1))
    return (template or RANKING_TEMPLATE).format(prompt=prompt, responses=listed, n=len(responses), reference=reference)


def prompt_hash(message: str, max_tokens: int, temperature: float) -> str:
    """The cache key of one judge call (with the judge's revision): its message and what decides its sampling."""
    key = {"messages": [{"role": "user", "content": message}], "max_tokens": max_tokens, "temperature": temperature}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def parse_rubric(
    raw: str, criteria: list[dict], verdicts: list[str], scores: list[float]
) -> tuple[float, list[dict]] | str:
    """(the weighted score in [0, 1], [{criterion, reason, verdict, score}]) of a rubric judge's answer, or what
    is wrong with it. Each criterion needs its reason line before its verdict line; the last of each counts.

    >>> c = [{"name": "correct", "weight": 3}, {"name": "brief", "weight": 1}]
    >>> out = "REASON correct: sorted.\\nVERDICT correct: Yes\\nREASON brief: long\\nVERDICT brief: partly"
    >>> score, rows = parse_rubric(out, c, ["no", "partly", "yes"], [0, 0.5, 1])
    >>> score, [r["verdict"] for r in rows]
    (0.875, ['yes', 'partly'])
    >>> parse_rubric("VERDICT correct: yes\\nREASON correct: why", c[:1], ["no", "yes"], [0, 1])
    'criterion correct: no REASON line before its VERDICT'
    >>> parse_rubric("REASON correct: x\\nVERDICT correct: maybe", c[:1], ["no", "yes"], [0, 1])
    "criterion correct: verdict 'maybe' is not one of no, yes"
    """
    by_word = {v.lower(): s for v, s in zip(verdicts, scores)}
    rows, total, weights = [], 0.0, 0.0
    for c in criteria:
        name = re.escape(c["name"])
        reasons = list(re.finditer(rf"(?im)^[\W_]*reason\s+{name}\s*:(.*)$", raw))
        said = list(re.finditer(rf"(?im)^[\W_]*verdict\s+{name}\s*:\s*[`*\"']*([A-Za-z0-9_-]*)", raw))
        if not said:
            return f"criterion {c['name']}: no VERDICT line"
        verdict = said[-1]
        reason = [r for r in reasons if r.start() < verdict.start()]
        if not reason:
            return f"criterion {c['name']}: no REASON line before its VERDICT"
        word = verdict.group(1).lower()
        if word not in by_word:
            return f"criterion {c['name']}: verdict {verdict.group(1)!r} is not one of {', '.join(verdicts)}"
        w = float(c.get("weight", 1.0))
        rows.append(
            {"criterion": c["name"], "reason": reason[-1].group(1).strip(), "verdict": word, "score": by_word[word]}
        )
        total, weights = total + w * by_word[word], weights + w
    return total / weights, rows


def parse_ranking(raw: str, n: int) -> tuple[list[float], list[dict]] | str:
    """(each response's score in [0, 1]: rank r of n scores (n - 1 - r) / (n - 1), [{criterion: "rank", reason,
    verdict: its rank from 1, score}] per response) of a ranking judge's answer, or what is wrong with it.

    >>> scores, rows = parse_ranking("REASON 2: right\\nRANKING: 2, 3, 1", 3)
    >>> scores, [(r["verdict"], r["reason"]) for r in rows]
    ([0.0, 1.0, 0.5], [('3', ''), ('1', 'right'), ('2', '')])
    >>> parse_ranking("RANKING: 1, 1, 2", 3)
    'RANKING must list 1..3 once each, got [1, 1, 2]'
    """
    found = list(re.finditer(r"(?im)^[\W_]*ranking\s*:\s*(.*)$", raw))
    if not found:
        return "no RANKING line"
    order = [int(x) for x in re.findall(r"\d+", found[-1].group(1))]
    if sorted(order) != list(range(1, n + 1)):
        return f"RANKING must list 1..{n} once each, got {order}"
    reasons = {int(m.group(1)): m.group(2).strip() for m in re.finditer(r"(?im)^[\W_]*reason\s+(\d+)\s*:(.*)$", raw)}
    rank = {i: r for r, i in enumerate(order)}
    scores = [(n - 1 - rank[i]) / max(n - 1, 1) for i in range(1, n + 1)]  # a group of one: 0
    rows = [
        {"criterion": "rank", "reason": reasons.get(i, ""), "verdict": str(rank[i] + 1), "score": scores[i - 1]}
        for i in range(1, n + 1)
    ]
    return scores, rows
