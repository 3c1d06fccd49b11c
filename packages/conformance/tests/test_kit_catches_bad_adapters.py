"""The kit fails — once, with a message naming the block list, block class, region and fix — on wrong
declarations, as a third party makes them.

The wrong declarations break a sound one at a time: Flux (shipped) and Qwen-Image, a family memfit does not
ship (``qwenimage/memfit_qwenimage``, the package the outside-the-repository test builds from the template).
"""

from __future__ import annotations

import dataclasses
import importlib
import textwrap
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest
import torch

import memfit
from memfit import Backend, BlockSpec, UnsupportedBoundaryError
from memfit_conformance import declaration
from memfit_conformance.declaration import check_declaration, check_entry_point
from memfit_conformance.harness import Combination

memfit_flux = pytest.importorskip("memfit_flux")
FLUX = memfit_flux.ADAPTER
QWEN_SRC = Path(__file__).parent / "qwenimage"
QWEN_BLOCK = "QwenImageTransformerBlock"


@pytest.fixture(scope="module")
def qwen():
    """The sound Qwen-Image adapter (imported from the test data; it is not installed)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(QWEN_SRC))
        return importlib.import_module("memfit_qwenimage").ADAPTER


def built(adapter):
    preset = adapter.presets["tiny"]
    model = preset.build()
    return model, preset.inputs(model, tokens=16, generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def flux_model():
    return built(FLUX)


@pytest.fixture(scope="module")
def qwen_model(qwen):
    return built(qwen)


def problems_of(adapter, model_and_inputs):
    """Every problem the kit finds (discovery aside: these adapters are built here, not installed)."""
    return [str(p) for p in check_declaration(adapter, *model_and_inputs, discovery=False)]


def with_block(adapter, name, **spec):
    return dataclasses.replace(adapter, blocks={**adapter.blocks, name: BlockSpec(**spec)})


# -- the sound declarations pass -------------------------------------------------------------------------------


def test_sound_declarations_have_no_problem(flux_model, qwen, qwen_model):
    assert check_declaration(FLUX, *flux_model) == []  # installed: its entry point is checked too
    assert problems_of(qwen, qwen_model) == []


# -- wrong declarations: exactly one problem each, naming where and the fix -------------------------------------


def test_undeclared_block_class(qwen, qwen_model):
    bad = dataclasses.replace(qwen, blocks={"QwenImageTransformerBlok": qwen.blocks[QWEN_BLOCK]})
    [problem] = problems_of(bad, qwen_model)
    assert f"transformer_blocks[0..2] ({QWEN_BLOCK})" in problem
    assert f"the block class {QWEN_BLOCK} is not declared" in problem
    assert "blocks declares 'QwenImageTransformerBlok': a typo?" in problem


def test_undeclared_block_class_of_a_second_list(flux_model):
    blocks = {k: v for k, v in FLUX.blocks.items() if k != "FluxSingleTransformerBlock"}
    [problem] = problems_of(dataclasses.replace(FLUX, blocks=blocks), flux_model)
    assert "single_transformer_blocks[0..3] (FluxSingleTransformerBlock)" in problem


def test_block_list_typo(qwen, qwen_model):
    [problem] = problems_of(dataclasses.replace(qwen, block_lists=("transformer_block",)), qwen_model)
    assert "block list 'transformer_block'" in problem
    assert "did you mean 'transformer_blocks'?" in problem


def test_block_list_typo_in_a_second_list(flux_model):
    bad = dataclasses.replace(FLUX, block_lists=("transformer_blocks", "single_blocks"))
    [problem] = problems_of(bad, flux_model)
    assert "block list 'single_blocks'" in problem and "'single_transformer_blocks'" in problem


def test_region_path_typo(flux_model):
    bad = with_block(
        FLUX, "FluxTransformerBlock", ffn=(("ff_typo",), ("ff_context",)), attention=(("attn",),)
    )
    [problem] = problems_of(bad, flux_model)
    assert "transformer_blocks[0..2] (FluxTransformerBlock), FFN region ('ff_typo',)" in problem
    assert "'ff_typo' is not a sub-module of FluxTransformerBlock (did you mean" in problem
    assert "'ff'" in problem


def test_non_chain_declared_as_chain(qwen, qwen_model):
    # img_mlp takes the *modulated* img_norm2 output, not img_norm2's output itself.
    bad = with_block(qwen, QWEN_BLOCK, ffn=(("img_norm2", "img_mlp"), ("txt_mlp",)), attention=(("attn",),))
    [problem] = problems_of(bad, qwen_model)
    assert f"transformer_blocks[0..2] ({QWEN_BLOCK}), FFN region ('img_norm2', 'img_mlp')" in problem
    assert "is not a chain: 'img_mlp' does not take an output of 'img_norm2'" in problem
    assert "declare the modules as separate regions" in problem


def test_non_chain_across_the_attention(flux_model):
    # proj_mlp's output goes to act_mlp; proj_out takes the concat of attention and MLP outputs.
    bad = with_block(
        FLUX, "FluxSingleTransformerBlock", ffn=(("proj_mlp", "proj_out"),), attention=(("attn",),)
    )
    [problem] = problems_of(bad, flux_model)
    assert (
        "single_transformer_blocks[0..3] (FluxSingleTransformerBlock), FFN region ('proj_mlp', 'proj_out')"
        in problem
    )
    assert "is not a chain" in problem


def test_chain_in_the_wrong_order(flux_model):
    bad = with_block(
        FLUX, "FluxSingleTransformerBlock", ffn=(("act_mlp", "proj_mlp"),), attention=(("attn",),)
    )
    [problem] = problems_of(bad, flux_model)
    assert "'proj_mlp' ran without 'act_mlp' right before it" in problem


def test_module_in_an_ffn_and_an_attention_region(qwen, qwen_model):
    bad = with_block(qwen, QWEN_BLOCK, ffn=(("img_mlp",), ("txt_mlp",)), attention=(("attn",), ("img_mlp",)))
    [problem] = problems_of(bad, qwen_model)
    assert f"transformer_blocks[0..2] ({QWEN_BLOCK})" in problem
    assert "'img_mlp' is in FFN region ('img_mlp',) and 'img_mlp' in attention region ('img_mlp',)" in problem
    assert "a module belongs to one region only" in problem


def test_attention_declared_as_ffn_and_as_attention(qwen, qwen_model):
    bad = with_block(qwen, QWEN_BLOCK, ffn=(("attn",), ("img_mlp",)), attention=(("attn",),))
    [problem] = problems_of(bad, qwen_model)
    assert "'attn' is in FFN region ('attn',) and 'attn' in attention region ('attn',)" in problem


def test_nested_regions(qwen, qwen_model):
    bad = with_block(qwen, QWEN_BLOCK, ffn=(("img_mlp",), ("img_mlp.net.2",)), attention=(("attn",),))
    [problem] = problems_of(bad, qwen_model)
    assert (
        "'img_mlp.net.2' (FFN region ('img_mlp.net.2',)) lies inside 'img_mlp' (FFN region ('img_mlp',))"
        in problem
    )


def test_nested_across_kinds(qwen, qwen_model):
    bad = with_block(qwen, QWEN_BLOCK, ffn=(("img_mlp",),), attention=(("attn",), ("img_mlp.net.0",)))
    [problem] = problems_of(bad, qwen_model)
    assert "'img_mlp.net.0' (attention region ('img_mlp.net.0',)) lies inside 'img_mlp'" in problem


def test_ffn_region_that_saves_nothing(qwen, qwen_model):
    bad = with_block(qwen, QWEN_BLOCK, ffn=(("img_norm2",), ("txt_mlp",)), attention=(("attn",),))
    [problem] = problems_of(bad, qwen_model)
    assert f"transformer_blocks[0..2] ({QWEN_BLOCK}), FFN region ('img_norm2',)" in problem
    assert "saves (almost) nothing" in problem


def test_lone_projection_as_ffn_saves_nothing(qwen, qwen_model):
    bad = with_block(qwen, QWEN_BLOCK, ffn=(("img_mlp.net.2",),), attention=(("attn",),))
    [problem] = problems_of(bad, qwen_model)
    assert "FFN region ('img_mlp.net.2',)" in problem and "saves (almost) nothing" in problem


def test_attention_region_that_is_not_attention(qwen, qwen_model):
    bad = with_block(qwen, QWEN_BLOCK, ffn=(("img_mlp",), ("txt_mlp",)), attention=(("img_mod",),))
    [problem] = problems_of(bad, qwen_model)
    assert f"transformer_blocks[0..2] ({QWEN_BLOCK}), attention region ('img_mod',)" in problem
    assert "does not call torch.nn.functional.scaled_dot_product_attention" in problem
    # The adapter may say why its attention runs another kernel; then SDPA is not required.
    stated = with_block(
        qwen,
        QWEN_BLOCK,
        ffn=(("img_mlp",),),
        attention=(("img_mod",),),
        attention_without_sdpa="custom kernel",
    )
    assert problems_of(stated, qwen_model) == []


def test_region_that_never_runs(flux_model):
    # `ff_context.net` is the ModuleList FeedForward iterates over: it exists, but is never called itself.
    bad = with_block(FLUX, "FluxTransformerBlock", ffn=(("ff",),), attention=(("attn",), ("ff_context.net",)))
    [problem] = problems_of(bad, flux_model)
    assert "attention region ('ff_context.net',): never ran" in problem


def test_block_count_config_key(qwen, qwen_model):
    bad = dataclasses.replace(qwen, block_count_config={"transformer_blocks": "num_single_layers"})
    [problem] = problems_of(bad, qwen_model)
    assert "the model config has no key 'num_single_layers'" in problem


@pytest.mark.parametrize(
    ("switch", "where", "what"),
    [
        (
            {"attribute": "checkpointing"},
            "model_checkpoint_switch.attribute",
            "QwenImageTransformer2DModel has no attribute 'checkpointing'",
        ),
        (
            {"config_key": "checkpoint"},
            "model_checkpoint_switch.config_key",
            "the config of QwenImageTransformer2DModel has no key 'checkpoint'",
        ),
    ],
)
def test_model_checkpoint_switch_that_is_not_there(qwen, qwen_model, switch, where, what):
    bad = dataclasses.replace(qwen, model_checkpoint_switch=memfit.CheckpointSwitch(**switch))
    [problem] = problems_of(bad, qwen_model)
    assert problem.startswith(f"{where}: {what}")


def test_model_checkpoint_switch_that_is_there(qwen, qwen_model):
    # diffusers' own flag (an attribute) and a key the config holds: both found
    sound = dataclasses.replace(
        qwen,
        model_checkpoint_switch=memfit.CheckpointSwitch(
            attribute="gradient_checkpointing", config_key="num_layers"
        ),
    )
    assert problems_of(sound, qwen_model) == []


# -- discovery: installed under its own name --------------------------------------------------------------------


def test_adapter_not_installed(qwen, qwen_model):
    [problem] = [str(p) for p in check_entry_point(qwen, qwen_model[0])]
    assert "no installed entry point is named 'qwenimage'" in problem
    assert "pip install -e ." in problem


def test_entry_point_name_differs_from_adapter_name(qwen, qwen_model, monkeypatch):
    monkeypatch.syspath_prepend(str(QWEN_SRC))
    installed = [EntryPoint("qwen-image", "memfit_qwenimage:ADAPTER", "memfit.adapters")]
    monkeypatch.setattr(declaration, "entry_points", lambda group: installed)
    [problem] = [str(p) for p in check_entry_point(qwen, qwen_model[0])]
    assert "entry point 'qwen-image' loads the adapter named 'qwenimage'" in problem
    assert "memfit.get_adapter('qwen-image') would fail" in problem


# -- the kit as pytest runs it: one failure, everything else skipped with the same reason ------------------------


def test_a_bad_declaration_fails_one_test_and_skips_the_rest(tmp_path):
    (tmp_path / "test_bad.py").write_text(
        textwrap.dedent(
            """
            import dataclasses

            import memfit_flux
            from memfit_conformance import AdapterConformance


            class TestBadFlux(AdapterConformance):
                adapter = dataclasses.replace(
                    memfit_flux.ADAPTER, block_lists=("transformer_blocks", "single_blocks")
                )
            """
        )
    )
    reports = _Reports()
    pytest.main([str(tmp_path), "-q", "-p", "no:cacheprovider", "-p", "no:randomly"], plugins=[reports])
    failed = [r for r in reports.all if r.failed]
    assert [r.nodeid.split("::")[-1] for r in failed] == ["test_declaration_is_valid"]
    assert "block list 'single_blocks'" in failed[0].longreprtext
    tests = [r for r in reports.all if r.when == "call" or (r.when == "setup" and r.skipped)]
    skipped = [r for r in tests if r.skipped]
    assert len(skipped) == len(tests) - 1 > 100  # every combination test was generated, none ran
    reasons = {r.longrepr[2] for r in skipped if "needs CUDA" not in r.longrepr[2]}  # GPU tests skip first
    assert len(reasons) == 1 and "test_declaration_is_valid" in reasons.pop()


class _Reports:
    def __init__(self) -> None:
        self.all = []

    def pytest_runtest_logreport(self, report) -> None:
        self.all.append(report)


def test_ffn_scope_on_a_family_without_ffn_is_refused_at_run_time(flux_model):
    no_ffn = dataclasses.replace(
        FLUX, blocks={k: dataclasses.replace(v, ffn=()) for k, v in FLUX.blocks.items()}
    )
    with pytest.raises(UnsupportedBoundaryError, match="family 'flux' declares no safe FFN boundary"):
        memfit.apply(flux_model[0], Combination(Backend.TORCH_FFN).config(), adapter=no_ffn)
