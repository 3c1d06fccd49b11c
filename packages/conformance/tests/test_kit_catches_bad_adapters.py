"""The kit fails — with a message naming the problem — on deliberately wrong adapter declarations."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from memfit import Backend, BlockSpec, UnsupportedBoundaryError
from memfit_conformance import AdapterConformance
from memfit_conformance.harness import Combination

memfit_flux = pytest.importorskip("memfit_flux")
FLUX = memfit_flux.ADAPTER


def kit_for(adapter):
    """A kit class for ``adapter`` (not collected: the name does not start with Test)."""
    return type("KitUnderTest", (AdapterConformance,), {"adapter": adapter})


def with_blocks(**blocks: BlockSpec):
    return dataclasses.replace(FLUX, blocks={**FLUX.blocks, **blocks})


@pytest.fixture(scope="module")
def model():
    return FLUX.presets["tiny"].build()


@pytest.fixture(scope="module")
def inputs(model):
    return FLUX.presets["tiny"].inputs(model, tokens=16, generator=torch.Generator().manual_seed(0))


def test_a_region_path_that_does_not_exist_fails(model):
    bad = with_blocks(FluxTransformerBlock=BlockSpec(ffn=(("ff_typo",),), attention=(("attn",),)))
    kit = kit_for(bad)()
    with pytest.raises(pytest.fail.Exception, match="'ff_typo' does not exist on FluxTransformerBlock"):
        kit.test_region_paths_resolve(model)


def test_a_chain_that_is_not_consecutive_fails(model, inputs):
    # proj_mlp's output goes to act_mlp, not to proj_out: proj_out runs after the attention and a concat.
    bad = with_blocks(
        FluxSingleTransformerBlock=BlockSpec(ffn=(("proj_mlp", "proj_out"),), attention=(("attn",),))
    )
    kit = kit_for(bad)()
    with pytest.raises(AssertionError, match="is not a chain"):
        kit.test_every_region_recomputed(model, inputs, Combination(Backend.TORCH_FFN))


def test_an_undeclared_block_class_fails(model):
    blocks = {k: v for k, v in FLUX.blocks.items() if k != "FluxSingleTransformerBlock"}
    kit = kit_for(dataclasses.replace(FLUX, blocks=blocks))()
    with pytest.raises(
        AssertionError, match="FluxSingleTransformerBlock, which the adapter does not declare"
    ):
        kit.test_every_block_class_declared(model)


def test_a_wrong_block_list_fails(model):
    kit = kit_for(dataclasses.replace(FLUX, block_lists=("transformer_blocks", "single_blocks")))()
    with pytest.raises(pytest.fail.Exception, match="single_blocks"):
        kit.test_block_lists_resolve(model)


def test_ffn_scope_on_a_family_without_ffn_is_refused_at_run_time(model):
    import memfit

    no_ffn = dataclasses.replace(
        FLUX, blocks={k: dataclasses.replace(v, ffn=()) for k, v in FLUX.blocks.items()}
    )
    with pytest.raises(UnsupportedBoundaryError, match="family 'flux' declares no safe FFN boundary"):
        memfit.apply(model, Combination(Backend.TORCH_FFN).config(), adapter=no_ffn)
