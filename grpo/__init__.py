"""grpo-flow: GRPO with verifiable rewards as batch stages over object storage.

`from grpo import train`: the Python API in TRL's shape (flows/api.py), loaded when asked for, so that `import grpo`
(and the `grpo` command line) stays cheap.
"""


def __getattr__(name: str):
    if name in ("train", "Trained"):
        from flows import api

        return getattr(api, name)
    raise AttributeError(f"module 'grpo' has no attribute {name!r}")
