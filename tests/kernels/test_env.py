"""``retmask.kernels.env.setting`` reads what ``os.environ.get`` would, after any change made through it."""

from __future__ import annotations

import os
from unittest import mock

import pytest

from retmask.kernels import env

NAME = "RETMASK_TEST_SETTING"


def test_setting_follows_every_change_made_through_os_environ(monkeypatch):
    monkeypatch.delenv(NAME, raising=False)
    assert env.setting(NAME) == ""
    monkeypatch.setenv(NAME, "  cpp ")
    assert env.setting(NAME) == "cpp" == os.environ.get(NAME, "").strip()
    os.environ[NAME] = "gemm"
    assert env.setting(NAME) == "gemm"
    os.environ.update({NAME: "blocked"})
    assert env.setting(NAME) == "blocked"
    with mock.patch.dict(os.environ, {NAME: "bf16dot"}):
        assert env.setting(NAME) == "bf16dot"
    assert env.setting(NAME) == "blocked"  # patch.dict restored the old value
    with mock.patch.dict(os.environ, clear=True):
        assert env.setting(NAME) == ""
    del os.environ[NAME]
    assert env.setting(NAME) == ""
    monkeypatch.setenv(NAME, "café")  # a non-ASCII value decodes as os.environ.get gives it
    assert env.setting(NAME) == "café"


@pytest.mark.parametrize("value", [None, "", " x "])
def test_setting_reads_os_environ_get_where_the_raw_dict_is_not_there(monkeypatch, value):
    """A stand-in ``os.environ`` without ``_data`` (Windows, or another Python) is read through ``get``."""
    fake = {} if value is None else {NAME: value}
    monkeypatch.setattr(os, "environ", fake)
    assert env.setting(NAME) == (value or "").strip()
