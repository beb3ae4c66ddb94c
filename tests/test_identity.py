"""The identity policy (grpo/identity.py): every config field is decided once, as covered by identities, added
later (left out at its defaults) or left out; a field added without a decision fails here and in every stage."""

import dataclasses

import pytest

from grpo import identity
from grpo.config import LearnConfig, RunConfig, load_config
from grpo.identity import UndecidedSetting, section, undecided


def test_every_field_of_every_section_is_decided_once():
    assert undecided(load_config(None)) == []
    for name, fields in identity.IDENTITY_FIELDS.items():
        added = {k for group in identity.ADDED_SETTINGS.get(name, ()) for k in group}
        left_out = set(identity.LEFT_OUT.get(name, ()))
        assert not (set(fields) & added) and not (set(fields) & left_out) and not (added & left_out), name


def with_new_learn_field(default):
    """A RunConfig whose learn section has one field more, as a change of the code would add it."""
    learn = dataclasses.make_dataclass("Learn", [("new_knob", type(default), dataclasses.field(default=default))],
                                       bases=(LearnConfig,), frozen=True)  # fmt: skip
    run = dataclasses.make_dataclass("Run", [("learn", learn, dataclasses.field(default_factory=learn))],
                                     bases=(RunConfig,), frozen=True)  # fmt: skip
    return run()


def test_a_field_added_without_a_decision_fails_every_identity_that_reads_its_section(monkeypatch):
    cfg = with_new_learn_field(0.5)
    assert undecided(cfg) == ["learn.new_knob"]
    with pytest.raises(UndecidedSetting, match="learn.new_knob: decide what identities make of it"):
        section(cfg, "learn")
    assert section(cfg, "rollout") == section(load_config(None), "rollout")  # other sections are unaffected
    before = section(load_config(None), "learn")  # what identities covered before the field existed
    # decided as a setting added later: left out at its default, so committed stages stay theirs
    monkeypatch.setitem(identity.ADDED_SETTINGS, "learn", identity.ADDED_SETTINGS["learn"] + (("new_knob",),))
    assert section(cfg, "learn") == before
    changed = dataclasses.replace(cfg, learn=dataclasses.replace(cfg.learn, new_knob=0.25))
    assert section(changed, "learn")["new_knob"] == 0.25
