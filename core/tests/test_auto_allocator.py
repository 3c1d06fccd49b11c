"""Reading the caching allocator's settings from the environment, as torch reads them."""

from __future__ import annotations

import pytest

from memfit.auto.allocator import ALLOC_CONF_VARIABLES, allocator_setting, expandable_segments


@pytest.fixture(autouse=True)
def no_settings(monkeypatch):
    for variable in ALLOC_CONF_VARIABLES:
        monkeypatch.delenv(variable, raising=False)


def test_the_default_allocator_has_no_expandable_segments():
    assert not expandable_segments() and allocator_setting("expandable_segments") is None


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("expandable_segments:True", True),
        ("max_split_size_mb:128, expandable_segments:true", True),
        ("expandable_segments:False", False),
        ("backend:cudaMallocAsync", False),
    ],
)
def test_expandable_segments_is_read_from_the_settings_list(monkeypatch, value, expected):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", value)
    assert expandable_segments() is expected


def test_where_both_variables_are_set_the_generic_one_is_read_as_torch_does(monkeypatch):
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:64")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert not expandable_segments()
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    assert expandable_segments()
