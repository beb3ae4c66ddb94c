"""Sizes and values that used to pass `grpo init` or a stage and fail later, hang, or fail naming nothing (issue 44,
D10 and the minor cases): each is refused at once in one line naming the setting, or handled."""

import pytest
from test_stages import TINY

from flows.cli import main
from stages import init


def grpo(tmp_path, capsys, *args) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(["--storage", str(tmp_path / "store"), *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def init_with(tmp_path, capsys, *sets: str) -> tuple[int, str, str]:
    return grpo(tmp_path, capsys, "init", "--run", "t", *[f"--set={s}" for s in [*TINY, *sets]])


@pytest.mark.parametrize(
    "setting, field",
    [
        ("rollout.prompts_per_iteration=100000000000", "rollout.prompts_per_iteration"),
        ("eval.n_prompts=100000000000", "eval.n_prompts"),
    ],
)
def test_sizes_no_machine_holds_are_refused_at_init(tmp_path, capsys, setting, field):
    """An iteration of 1e11 prompts passed init, then grew ~20 MB/s without a word."""
    rc, _, err = init_with(tmp_path, capsys, setting)
    assert rc == 2 and err.count("\n") == 1 and f"lower {field}" in err, err
    assert "GiB, more than this machine's" in err and not (tmp_path / "store" / "runs" / "t").exists()


def test_the_memory_bound_leaves_real_sizes_alone():
    from grpo.config import load_config

    big = load_config(None, ["rollout.prompts_per_iteration=1024", "rollout.group_size=16", "rollout.max_tokens=4096"])
    init.check_sizes(big, memory=8 * 2**30)  # 16k samples of 4k tokens fit in 8 GiB at the bound's 32 B a token
    with pytest.raises(init.ConfigError, match="lower rollout.prompts_per_iteration"):
        init.check_sizes(big, memory=2**30)
