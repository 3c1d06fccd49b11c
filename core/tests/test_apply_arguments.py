"""``memfit.apply``'s arguments: a wrong type is a TypeError that says what to pass, never an AttributeError."""

from __future__ import annotations

import pytest
import torch

import memfit
from memfit import MemfitError

ON = {"gradient_checkpointing": True}


@pytest.mark.parametrize("model", [None, object(), torch.zeros(3), "FluxTransformer2DModel"])
def test_a_model_that_is_not_a_module_is_a_type_error(model):
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        memfit.apply(model, ON)


def test_an_adapter_given_by_family_name_is_looked_up():
    flux = pytest.importorskip("memfit_flux").ADAPTER
    model = flux.presets["tiny"].build()
    with memfit.apply(model, ON, adapter="flux") as handle:
        assert handle.family == "flux"
    with pytest.raises(MemfitError, match="no memfit adapter for family 'flx'"):
        memfit.apply(model, ON, adapter="flx")


@pytest.mark.parametrize("adapter", [3, object(), {"name": "flux"}])
def test_an_adapter_of_another_type_is_a_type_error(adapter):
    with pytest.raises(TypeError, match="FamilyAdapter or an installed family's name"):
        memfit.apply(torch.nn.Linear(2, 2), ON, adapter=adapter)
