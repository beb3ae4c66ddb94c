"""The identity policy (grpo/record/identity.py): every config field is decided once, as covered by identities, added
later (left out at its defaults) or left out; a field added without a decision fails here and in every stage."""

import dataclasses

import pytest

from grpo.config import LearnConfig, RunConfig, load_config
from grpo.record import identity
from grpo.record.identity import UndecidedSetting, section, undecided


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


def test_a_renamed_setting_reads_from_an_old_run_json_and_keeps_its_old_name_in_identities():
    """learn.importance_correction became learn.behavior_correction: a run.json that stores the old name reads as the
    new one, and the learn section identities hash still names it as runs committed it (grpo.config.RENAMED)."""
    stored = load_config(None).to_dict()
    stored["learn"]["importance_correction"] = "tis"
    del stored["learn"]["behavior_correction"]
    cfg = identity.stored_config(stored)
    assert cfg.learn.behavior_correction == "tis"
    learn = section(cfg, "learn")
    assert learn["importance_correction"] == "tis" and "behavior_correction" not in learn
    mis = section(load_config(None, ["learn.behavior_correction=mis", "learn.behavior_level=sequence"]), "learn")
    assert mis["importance_correction"] == "mis" and mis["behavior_level"] == "sequence"  # set: in the identity
    assert mis["mis_bounds"] == [0.0, 2.0]  # a group acts together: its defaults come with it
    assert "behavior_level" not in section(load_config(None), "learn")  # at their defaults: left out
