"""The one rule for llminfer's on/off environment switches (``llminfer.env.env_flag``)."""

from __future__ import annotations

import pytest

from llminfer.env import env_flag


@pytest.mark.parametrize(("value", "on"), [("0", False), ("false", False), (" OFF ", False), ("No", False),
                                           ("1", True), ("yes", True), ("on", True), ("", True), ("2", True)])
def test_a_set_switch_is_off_only_for_the_off_words(value, on, monkeypatch):
    monkeypatch.setenv("LLMINFER_TEST_SWITCH", value)
    assert env_flag("LLMINFER_TEST_SWITCH") is on
    assert env_flag("LLMINFER_TEST_SWITCH", default=False) is on


@pytest.mark.parametrize("default", [True, False])
def test_an_unset_switch_takes_its_default(default, monkeypatch):
    monkeypatch.delenv("LLMINFER_TEST_SWITCH", raising=False)
    assert env_flag("LLMINFER_TEST_SWITCH", default=default) is default
