"""Credentials kept from reward code: a reward worker starts with every credential variable removed from its
environment (and from the environment block /proc/self/environ shows), and what comes back from it (errors,
component names, printed output) has the values of those variables, and of those reward.pass_env passes on, replaced
by their names before the stage commits or logs it.

Reward code is untrusted (a user's function, or a code-execution reward running what the model wrote), and a
forked worker would otherwise inherit AWS_SECRET_ACCESS_KEY, tokens and API keys. Redaction is the backstop
for what the removal cannot reach: the stage's own /proc/PID/environ, readable by the same user, and objects
the fork copied from the stage's memory. Code bent on leaking a secret in a form it alone can decode needs a
sandbox (another user, a container), which this is not.
"""

from __future__ import annotations

import ctypes
import dataclasses
import fnmatch
import os
from typing import Any, Iterable, Mapping

CREDENTIALS = (
    "AWS_*",
    "AZURE_*",
    "GOOGLE_APPLICATION_CREDENTIALS",
    "*_TOKEN",
    "*_TOKEN_*",
    "*SECRET*",
    "*_KEY",
    "*_KEY_ID",
    "*PASSWORD*",
    "*PASSWD*",
    "*CREDENTIAL*",
    "*AUTH_STRING*",
)
"""Names (fnmatch patterns, matched upper-cased) of the environment variables reward workers never see, unless
reward.pass_env names them; PREFECT_API_KEY, HF_TOKEN and GITHUB_TOKEN among them."""

MIN_REDACTED = 8
"""Values shorter than this are not redacted: no credential is that short, and replacing them would blank
ordinary words (AWS_DEFAULT_REGION=us-east-1 is removed, "true" of a flag is not redacted)."""


def credential_names(environ: Mapping[str, str], pass_env: Iterable[str] = ()) -> list[str]:
    """The variables of `environ` a reward worker loses: those matching CREDENTIALS, less pass_env.

    >>> env = {"AWS_SECRET_ACCESS_KEY": "x", "HF_TOKEN": "y", "PATH": "/bin", "MY_API_KEY": "z"}
    >>> credential_names(env, ["HF_TOKEN"])
    ['AWS_SECRET_ACCESS_KEY', 'MY_API_KEY']
    """
    keep = set(pass_env)
    return [k for k in environ if k not in keep and any(fnmatch.fnmatchcase(k.upper(), p) for p in CREDENTIALS)]


def secret_values(environ: Mapping[str, str], pass_env: Iterable[str] = ()) -> dict[str, str]:
    """{value: variable name} of what comes back from reward code redacted: every credential of `environ`, those
    pass_env passes to the workers too (a judge's API key is read, never committed or logged), and every variable
    pass_env names; longest value first, each long enough to be worth redacting.

    >>> env = {"AWS_SECRET_ACCESS_KEY": "s" * 9, "JUDGE_URL": "https://judge", "HOME": "/home/me"}
    >>> secret_values(env, ["JUDGE_URL"])
    {'https://judge': 'JUDGE_URL', 'sssssssss': 'AWS_SECRET_ACCESS_KEY'}
    """
    names = [*credential_names(environ), *(k for k in pass_env if k in environ)]
    found = {environ[k]: k for k in names if len(environ[k]) >= MIN_REDACTED}
    return dict(sorted(found.items(), key=lambda kv: -len(kv[0])))


def redact(obj: Any, secrets: Mapping[str, str]) -> Any:
    """obj with every secret value in its strings (dict keys included, through lists, tuples, dicts and dataclass
    instances, such as the Reply an environment answers in) replaced by `<NAME redacted>`.

    >>> redact([("KeyError: 'k=abcdefgh1'", {"abcdefgh1": 1.0})], {"abcdefgh1": "AWS_SECRET_ACCESS_KEY"})
    [("KeyError: 'k=<AWS_SECRET_ACCESS_KEY redacted>'", {'<AWS_SECRET_ACCESS_KEY redacted>': 1.0})]
    >>> @dataclasses.dataclass(frozen=True)
    ... class Reply:
    ...     messages: list
    >>> redact(Reply([{"role": "tool", "content": "abcdefgh1"}]), {"abcdefgh1": "MY_KEY"})
    Reply(messages=[{'role': 'tool', 'content': '<MY_KEY redacted>'}])
    """
    if not secrets:
        return obj
    if isinstance(obj, str):
        for value, name in secrets.items():
            if value in obj:
                obj = obj.replace(value, f"<{name} redacted>")
        return obj
    if isinstance(obj, bytes):
        return redact(obj.decode(errors="backslashreplace"), secrets).encode()
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple
        return type(obj)(*(redact(x, secrets) for x in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(redact(x, secrets) for x in obj)
    if isinstance(obj, dict):
        return {redact(k, secrets): redact(v, secrets) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = [f.name for f in dataclasses.fields(obj) if f.init]
        return dataclasses.replace(obj, **{name: redact(getattr(obj, name), secrets) for name in fields})
    return obj


def redact_cut(text: str, secrets: Mapping[str, str]) -> str:
    """redact(text), and a secret's first characters where `text` was cut short in its middle.

    >>> redact_cut("key: abcdefg", {"abcdefgh1": "MY_KEY"})
    'key: <MY_KEY redacted>'
    """
    text = redact(text, secrets)
    for value, name in secrets.items():
        for k in range(min(len(value) - 1, len(text)), 3, -1):
            if text.endswith(value[:k]):
                return text[:-k] + f"<{name} redacted>"
    return text


def remove_credentials(pass_env: Iterable[str] = ()) -> list[str]:
    """In a freshly forked worker: drop the credential variables from os.environ (so from what it starts too)
    and blank their entries in the environment block the process was exec'd with. Returns their names."""
    names = credential_names(os.environ, pass_env)
    for name in names:
        os.environ.pop(name, None)  # unsetenv: the C environment too
    _blank_exec_environ(names)
    return names


def _blank_exec_environ(names: list[str]) -> None:
    """Overwrite NAME=value of `names` in this process's exec-time environment block (Linux; /proc/self/environ
    reads it) with zeros; this process's copy only (copy on write). Nothing refers to those bytes once unset."""
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        start, end = int(fields[-3]), int(fields[-2])  # env_start, env_end: stat fields 50 and 51
        with open("/proc/self/environ", "rb") as f:
            block = f.read()
    except (OSError, ValueError, IndexError):
        return
    if len(block) > end - start:
        return
    prefixes = tuple(f"{n}=".encode() for n in names)
    at = 0
    for entry in block.split(b"\0"):
        if entry.startswith(prefixes):
            ctypes.memset(start + at, 0, len(entry))
        at += len(entry) + 1
