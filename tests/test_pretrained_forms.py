"""A step graph's form (`attnexport.pretrained.forms`): the base every family's forms are made
from, the table the families register theirs in, and the refusals a form gives for what it takes not."""

import pytest

from attnexport.errors import UsageError
from attnexport.pretrained import forms as FM
from attnexport.pretrained import registry


def test_every_family_s_forms_are_registered_and_each_belongs_to_one_family():
    registry.families()
    owners = {name: [f.task for f in registry.FAMILIES.values() if name in f.forms] for name in FM.FORMS}
    assert all(len(tasks) == 1 for tasks in owners.values()), owners
    assert {n for f in registry.FAMILIES.values() for n in f.forms} == set(FM.FORMS)


def test_a_form_is_refused_by_name_with_the_forms_a_family_takes():
    registry.families()
    with pytest.raises(UsageError, match="--kv-cache for --hf is one of none, concat, static, got 'ring'"):
        FM.form("ring", ("none", "concat", "static"))
    with pytest.raises(UsageError, match="--max-seq sizes the static cache's buffers"):
        FM.no_max_seq(16)
    FM.no_max_seq(0)


def test_a_new_form_is_a_class_and_one_registration():
    class Whole(FM.CacheForm):
        name = "whole-test"

    try:
        FM.register(Whole())
        assert FM.form("whole-test", ("whole-test",)).name == "whole-test"
        assert not Whole().caches and Whole().cache_names(None, "past") == []
        with pytest.raises(NotImplementedError):  # what every form must say of itself
            Whole().inputs(None)
    finally:
        del FM.FORMS["whole-test"]
