"""The base test class an adapter's test module subclasses.

Capabilities are declared by the adapter (FFN regions, interval support), never guessed:
the kit derives the combinations to check from the declarations, and checks the
declarations themselves against the real model class first, once
(:mod:`memfit_conformance.declaration`): a wrong declaration fails ``test_declaration_is_valid``
with every problem listed, and the rest of the kit is skipped with a reason pointing there.
"""

from __future__ import annotations

import dataclasses
import gc
import traceback
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

import memfit
from memfit import Backend, BlockPolicy, FamilyAdapter, MemfitWarning, UnsupportedBoundaryError
from memfit.offload.copy import SyncCopyEngine
from memfit.offload.pool import PinnedBucketPool
from memfit_conformance.declaration import Problem, check_declaration, describe
from memfit_conformance.harness import (
    Combination,
    StepResult,
    assert_same_step,
    claimed_combinations,
    closure_style_checkpointing,
    output_tensors,
    run_step,
    switch_values,
    switched_on,
)
from memfit_conformance.plugin import require_cuda
from memfit_conformance.streams import order_checking_copy_engine


def cpu_copy_engine() -> SyncCopyEngine:
    """Parking into pageable CPU buffers, with the pool's bookkeeping (no CUDA needed)."""
    pool = PinnedBucketPool(
        allocate=lambda n, pinned: torch.empty(n, dtype=torch.uint8),
        available_host_bytes=lambda: 1 << 40,
        host_reserve_bytes=0,
    )
    return SyncCopyEngine(pool)


@dataclasses.dataclass
class Declaration:
    """The kit's one check of the adapter's declaration, shared by every test of the class.

    Args:
        model: the preset's model (None if the preset failed to build it or its inputs).
        inputs: the preset's forward kwargs.
        problems: what is wrong with the declaration (empty: sound).
        message: the failure message listing every problem ("" when sound).
    """

    model: nn.Module | None
    inputs: dict[str, Any] | None
    problems: list[Problem]
    message: str

    def require_valid(self) -> None:
        """Skip the calling test while the declaration is wrong: the one failure is test_declaration_is_valid.

        Raises:
            pytest.skip.Exception: with the same reason for every test (pytest's ``-ra`` folds them into one line).
        """
        if self.problems:
            pytest.skip(
                f"the declaration has {len(self.problems)} problem(s), listed by the failing "
                f"test_declaration_is_valid; the rest of the kit runs once they are fixed"
            )


class AdapterConformance:
    """Subclass with ``adapter = <your FamilyAdapter>``; optionally override the knobs below.

    Knobs:
        preset: which adapter preset to build (default ``"tiny"``).
        tokens: image tokens of the dummy inputs (default: the preset's).
        grad_inputs: forward kwargs that get ``requires_grad`` (their gradients are compared too).
        rtol, atol: tolerance for outputs/gradients on CPU fp32; 0 means bitwise (the default: the
            recompute runs the very same kernels on the very same values, so results are identical).
        gpu_rtol, gpu_atol: tolerance for the bf16 GPU comparison (bf16 has 8 mantissa bits; kernels
            may pick different reduction orders between runs).
        gpu_tokens: image tokens for the GPU tests (large enough that activations dominate the peak).
    """

    adapter: ClassVar[FamilyAdapter]
    preset: ClassVar[str] = "tiny"
    tokens: ClassVar[int | None] = None
    grad_inputs: ClassVar[tuple[str, ...]] = ("hidden_states",)
    rtol: ClassVar[float] = 0.0
    atol: ClassVar[float] = 0.0
    gpu_rtol: ClassVar[float] = 2e-2
    gpu_atol: ClassVar[float] = 2e-2
    gpu_tokens: ClassVar[int] = 8192

    # -- parametrization ---------------------------------------------------------------------------------------

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        if "combo" in metafunc.fixturenames:
            combos = claimed_combinations(self.adapter)
            metafunc.parametrize("combo", combos, ids=[str(c) for c in combos])
        if "regime" in metafunc.fixturenames:
            metafunc.parametrize("regime", ["full", "frozen"])
        if "block_combo" in metafunc.fixturenames:
            combos = [c for c in claimed_combinations(self.adapter) if c.backend and not c.backend.ffn_only]
            metafunc.parametrize("block_combo", combos, ids=[str(c) for c in combos])
        if "switch_case" in metafunc.fixturenames:
            cases = ["hooks"] + (["ffn"] if self.adapter.has_ffn else [])
            metafunc.parametrize("switch_case", cases)

    # -- fixtures ----------------------------------------------------------------------------------------------

    @classmethod
    def build_model(cls, **kwargs: Any) -> nn.Module:
        return cls.adapter.presets[cls.preset].build(**kwargs)

    @classmethod
    def make_inputs(cls, model: nn.Module, seed: int = 0) -> dict[str, Any]:
        preset = cls.adapter.presets[cls.preset]
        g = torch.Generator().manual_seed(seed)
        return preset.inputs(model, tokens=cls.tokens or preset.default_tokens, generator=g)

    @pytest.fixture(scope="class")
    @classmethod
    def declaration(cls) -> Declaration:
        """Build the preset's model and inputs and check the declaration on them, once per test class."""
        try:
            model = cls.build_model()
            inputs = cls.make_inputs(model)
        except Exception as exc:
            problem = Problem(
                f"preset {cls.preset!r}",
                f"building the model or its inputs raised {type(exc).__name__}: {exc}\n"
                + "".join(traceback.format_exception(exc)[-6:]),
                "fix the preset's build / inputs functions (the kit builds them exactly as `memfit fit` does)",
            )
            return Declaration(None, None, [problem], describe(cls.adapter, None, [problem]))
        problems = check_declaration(cls.adapter, model, inputs)
        return Declaration(
            model, inputs, problems, describe(cls.adapter, model, problems) if problems else ""
        )

    @pytest.fixture(autouse=True)
    def _declaration_checked_first(self, request: pytest.FixtureRequest, declaration: Declaration) -> None:
        if request.function.__name__ != "test_declaration_is_valid":
            declaration.require_valid()

    @pytest.fixture(scope="class")
    @classmethod
    def model(cls, declaration: Declaration) -> nn.Module:
        declaration.require_valid()
        return declaration.model

    @pytest.fixture(scope="class")
    @classmethod
    def inputs(cls, declaration: Declaration) -> dict[str, Any]:
        declaration.require_valid()
        return declaration.inputs

    @pytest.fixture(scope="class")
    @classmethod
    def reference(cls, model: nn.Module, inputs: dict[str, Any]) -> dict[str, StepResult]:
        return {regime: cls._step(model, inputs, regime) for regime in ("full", "frozen")}

    @classmethod
    def _step(cls, model: nn.Module, inputs: dict[str, Any], regime: str) -> StepResult:
        for p in model.parameters():
            p.requires_grad_(regime == "full")
        try:
            return run_step(model, inputs, cls.adapter.loss, grad_inputs=cls.grad_inputs)
        finally:
            for p in model.parameters():
                p.requires_grad_(True)

    @classmethod
    def apply(cls, model: nn.Module, config: dict[str, Any]) -> memfit.MemfitHandle:
        """``memfit.apply`` for the kit. Offload modes of a CPU model park through the CUDA copy engine over
        recording streams whose events never complete by themselves (:mod:`memfit_conformance.streams`):
        the same parking, dedup, pool and stream ordering as on CUDA, with synchronous copies into pageable
        buffers, and every reload and every use of a reloaded tensor checked for its wait.
        ``min_offload_bytes=0`` so the tiny model's tensors are parked too."""
        cfg = memfit.MemfitConfig.from_dict(config)
        offloads = cfg.offload_attention or (cfg.enabled and cfg.backend.offloads_inputs)
        device = next(model.parameters()).device
        if offloads and device.type == "cpu":
            return memfit.apply(
                model,
                config,
                adapter=cls.adapter,
                copy_engine=order_checking_copy_engine(),
                min_offload_bytes=0,
            )
        if offloads:
            return memfit.apply(model, config, adapter=cls.adapter, min_offload_bytes=0)
        return memfit.apply(model, config, adapter=cls.adapter)

    def _step_with(
        self, model: nn.Module, inputs: dict[str, Any], config: dict[str, Any], regime: str = "full"
    ) -> tuple[StepResult, dict[str, Any]]:
        with self.apply(model, config) as handle:
            result = self._step(model, inputs, regime)
            result.stats = handle.stats()
        return result, result.stats

    # -- the declaration itself, checked once before everything else ---------------------------------------------

    def test_declaration_is_valid(self, declaration: Declaration) -> None:
        """Discoverable under its own name; block lists, block classes and region paths resolve on the model;
        no module in two regions; every chain is a chain; attention regions run SDPA; FFN regions free bytes."""
        if declaration.problems:
            pytest.fail(declaration.message, pytrace=False)

    def test_gradients_reach_the_declared_inputs(self, reference: dict[str, StepResult]) -> None:
        missing = [n for n in self.grad_inputs if n not in reference["full"].input_grads]
        assert not missing, (
            f"grad_inputs {missing} got no gradient (not a tensor forward argument, or not on the graph): the "
            f"kit would compare no input gradient. Set `grad_inputs` to tensor kwargs of the forward."
        )

    # -- equivalence, counting, saving: every claimed combination --------------------------------------------------

    def test_outputs_and_gradients_equal(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        reference: dict[str, StepResult],
        combo: Combination,
        regime: str,
    ) -> None:
        result, _ = self._step_with(model, inputs, combo.config(), regime)
        assert_same_step(
            reference[regime],
            result,
            what=f"{self.adapter.name} {combo} ({regime})",
            rtol=self.rtol,
            atol=self.atol,
        )

    def test_bfloat16_attention_offload_gives_the_same_gradients(self) -> None:
        """In bfloat16, attention offload holds and parks the float32 up-casts it can prove exact (an RMS norm's
        ``x.to(float32)``) as bfloat16 copies, widened again in backward (:mod:`memfit.offload.narrow`): the
        same bits as the unmodified bfloat16 model, whether or not this family saves any."""
        if not self.adapter.has_attention:
            pytest.skip(f"{self.adapter.name} declares no attention region: attention offload does not apply")
        model = self.build_model(dtype=torch.bfloat16)
        inputs = self.make_inputs(model)
        reference = self._step(model, inputs, "full")
        result, stats = self._step_with(model, inputs, {"gradient_checkpointing_offload_attention": True})
        assert stats["bytes_offloaded"] > 0, "attention offload parked nothing"
        assert_same_step(
            reference,
            result,
            what=f"{self.adapter.name} attention offload in bfloat16 ({stats['bytes_narrowed']} bytes narrowed)",
            rtol=self.rtol,
            atol=self.atol,
        )

    def test_every_region_recomputed(
        self, model: nn.Module, inputs: dict[str, Any], combo: Combination
    ) -> None:
        with self.apply(model, combo.config()) as handle:
            self._step(model, inputs, "full")
            gc.collect()  # the step's graph is gone: every frame was either recomputed or freed unused
            stats = handle.stats()
        if combo.offloads:
            # The regions of the step's timeline: every frame (parked or keeping its entries), every offloaded
            # attention call, and every block a stride leaves out that keeps everything. The last two are never
            # parked: backward needs the last first and reloads the one before as that one's backward begins,
            # so parking them frees nothing at the peak. So two regions or fewer park nothing, and three parking
            # regions or more (frames of an offloading backend, attention calls) park something; in between it
            # depends on where the parking regions fall.
            frames = self.expected_frames(model, combo) if combo.backend else 0
            kept_blocks = sum(1 for b in handle.region_plan.blocks if b.policy is BlockPolicy.KEEP)
            regions = frames + stats["attention_calls_offloaded"] + kept_blocks
            assert stats["step_regions"] == regions, (
                f"{combo}: {stats['step_regions']} regions in the step's offload timeline, expected {regions}"
            )
            parking = stats["attention_calls_offloaded"] + (
                frames if combo.backend and combo.backend.offloads_inputs else 0
            )
            if regions <= 2:
                assert stats["bytes_offloaded"] == 0, f"{combo}: {stats['bytes_offloaded']} bytes parked"
            if parking >= 3:
                assert stats["bytes_offloaded"] > 0, f"{combo}: nothing parked by {parking} parking regions"
            assert stats["host_buffers_in_use"] == 0, f"{combo}: host buffers not returned after backward"
        if combo.offload_attention:
            expect_attn = combo.backend in (None, Backend.TORCH_FFN, Backend.UNSLOTH_FFN) or combo.stride
            assert (stats["attention_calls_offloaded"] > 0) == bool(expect_attn), (
                f"{combo}: {stats['attention_calls_offloaded']} attention calls parked"
            )
        if combo.backend is None:
            assert stats["frames"] == 0
            return
        self.assert_regions_as_declared(model, combo, stats)

    def assert_regions_as_declared(self, model: nn.Module, combo: Combination, stats: dict[str, Any]) -> None:
        """One step's regions are exactly those the declarations imply for ``combo``, each recomputed once (or
        freed unused), none undeclared."""
        expected = self.expected_frames(model, combo)
        assert stats["undeclared_block_calls"] == 0, (
            "the model checkpointed blocks the adapter did not declare"
        )
        assert stats["chain_breaks"] == 0, (
            f"{combo}: a declared region chain is not a chain: a later module of it did not consume the output "
            f"of the earlier ones (something else runs in between). Declare the modules as separate regions, "
            f"or only the consecutive part."
        )
        assert stats["frames"] == expected, (
            f"{combo}: {stats['frames']} regions ran, the declarations imply {expected}: a declared region "
            f"was not called as a chain of consecutive calls (unsafe or wrong boundary), never ran, or ran "
            f"again nested in the model's own checkpointing"
        )
        # A region whose outputs never reach the loss (a double-stream model's last text update) is freed
        # without a recompute; every other region must be recomputed exactly once.
        assert stats["recomputes"] + stats["unused"] == expected, (
            f"{combo}: {stats['recomputes']} recomputed + {stats['unused']} unused != {expected} regions"
        )
        assert stats["recomputes"] > 0
        assert stats["calls"] == self.expected_calls(model, combo)

    def assert_same_with_declared_regions(
        self,
        model: nn.Module,
        combo: Combination,
        expected: StepResult,
        result: StepResult,
        stats: dict[str, Any],
        label: str,
    ) -> None:
        """Outputs and gradients equal to the unmodified model's, and the regions the declarations imply."""
        what = f"{self.adapter.name} {combo} ({label})"
        assert_same_step(expected, result, what=what, rtol=self.rtol, atol=self.atol)
        self.assert_regions_as_declared(model, combo, stats)

    # -- how trainers call it, and the model's own checkpointing switch ---------------------------------------------

    def test_trainer_style_closure_entry(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        reference: dict[str, StepResult],
        block_combo: Combination,
    ) -> None:
        """Trainer code calls the model's checkpointing function with a closure over the block (not the block) and
        ``use_reentrant=False``: the same outputs and gradients, and the same regions, as a block passed directly."""
        combo = block_combo
        with self.apply(model, combo.config()) as handle, closure_style_checkpointing(model) as passed:
            if passed is None:
                pytest.skip(
                    f"memfit enters {type(model).__name__}'s blocks through forward hooks (the adapter's "
                    f"block_entry is 'hooks', or the model has no diffusers checkpointing hook): its checkpointing "
                    f"branch never calls memfit"
                )
            result = self._step(model, inputs, "full")
            gc.collect()
            stats = handle.stats()
        assert passed, f"{combo}: the model never called its checkpointing function in a training step"
        self.assert_same_with_declared_regions(
            model, combo, reference["full"], result, stats, "closure entry"
        )

    def test_model_checkpoint_switch_is_turned_off_and_restored(
        self, model: nn.Module, inputs: dict[str, Any], reference: dict[str, StepResult], switch_case: str
    ) -> None:
        """The model's own checkpointing switch the adapter declares, on when memfit is applied with its blocks
        entered through hooks (``hooks``: whole blocks, interval 2; ``ffn``: FFN regions): turned off with one
        warning, so no region runs nested in the model's own checkpoint calls; restored exactly by remove()."""
        switch = self.adapter.model_checkpoint_switch
        if switch is None:
            pytest.skip(
                "the family declares no model-owned checkpointing switch (FamilyAdapter.model_checkpoint_switch)"
            )
        if switch_case == "hooks":
            adapter, combo = (
                dataclasses.replace(self.adapter, block_entry="hooks"),
                Combination(Backend.TORCH, 2),
            )
        else:
            adapter, combo = self.adapter, Combination(Backend.TORCH_FFN)
        with switched_on(model, switch) as on:
            with pytest.warns(MemfitWarning) as record:
                handle = memfit.apply(model, combo.config(), adapter=adapter)
            ours = [w for w in record if issubclass(w.category, MemfitWarning)]
            with handle:
                assert len(ours) == 1, (
                    f"{combo}: {len(ours)} MemfitWarnings, expected one: {[str(w.message) for w in ours]}"
                )
                named = switch.attribute or f"config.{switch.config_key}"
                assert named in str(ours[0].message), f"the warning does not name the switch {named!r}"
                still_on = {place: value for place, value in switch_values(model, switch).items() if value}
                assert not still_on, (
                    f"{combo}: the model's own switch is still on while memfit is applied: {still_on}"
                )
                result = self._step(model, inputs, "full")
                gc.collect()
                stats = handle.stats()
            after = switch_values(model, switch)
            assert after.keys() == on.keys() and all(after[k] is on[k] for k in on), (
                f"remove() did not restore the model's own switch: {after}, was {on}"
            )
        self.assert_same_with_declared_regions(
            model, combo, reference["full"], result, stats, "own switch on"
        )

    def test_held_bytes_drop(
        self, model: nn.Module, inputs: dict[str, Any], reference: dict[str, StepResult], combo: Combination
    ) -> None:
        result, _ = self._step_with(model, inputs, combo.config())
        baseline = reference["full"].held_bytes
        assert result.held_bytes < baseline, (
            f"{combo} holds {result.held_bytes} bytes for backward, the unmodified model {baseline}: "
            f"this mode saves nothing"
        )

    # -- relations between modes ------------------------------------------------------------------------------------

    def test_torch_holds_less_than_torch_ffn(self, model: nn.Module, inputs: dict[str, Any]) -> None:
        if not self.adapter.has_ffn:
            pytest.skip("family declares no FFN boundary (checked by test_ffn_scope_fails_without_boundary)")
        whole, _ = self._step_with(model, inputs, Combination(Backend.TORCH).config())
        ffn, _ = self._step_with(model, inputs, Combination(Backend.TORCH_FFN).config())
        assert whole.held_bytes < ffn.held_bytes

    def test_interval_chunk_keeps_one_entry_set(self, model: nn.Module, inputs: dict[str, Any]) -> None:
        if not self.adapter.supports_interval:
            pytest.skip(
                "family declares no interval support (checked by test_interval_warns_when_unsupported)"
            )
        one, s1 = self._step_with(model, inputs, Combination(Backend.TORCH, 1).config())
        two, s2 = self._step_with(model, inputs, Combination(Backend.TORCH, 2).config())
        assert s2["frames"] < s1["frames"]
        assert s2["entries"] < s1["entries"], "an interval-2 chunk kept the entries of each of its blocks"
        assert two.held_bytes < one.held_bytes

    def test_interval_warns_when_unsupported(self, model: nn.Module) -> None:
        if self.adapter.supports_interval:
            pytest.skip("family supports interval")
        with pytest.warns(MemfitWarning, match="interval"):
            memfit.apply(model, Combination(Backend.TORCH, 2).config(), adapter=self.adapter).remove()

    def test_no_grad_records_nothing(self, model: nn.Module, inputs: dict[str, Any]) -> None:
        for combo in claimed_combinations(self.adapter, intervals=(1,)):
            with self.apply(model, combo.config()) as handle, torch.no_grad():
                model(**inputs)
                stats = handle.stats()
                assert stats["frames"] == 0, f"{combo}: regions recorded under torch.no_grad()"
                assert stats.get("bytes_offloaded", 0) == 0, f"{combo}: tensors parked under torch.no_grad()"

    # -- explicit failure for undeclared scopes ---------------------------------------------------------------------

    def test_ffn_scope_fails_without_boundary(self, model: nn.Module) -> None:
        stripped = dataclasses.replace(
            self.adapter,
            blocks={name: dataclasses.replace(spec, ffn=()) for name, spec in self.adapter.blocks.items()},
        )
        with pytest.raises(UnsupportedBoundaryError, match=self.adapter.name):
            memfit.apply(model, Combination(Backend.TORCH_FFN).config(), adapter=stripped)
        if not self.adapter.has_ffn:
            with pytest.raises(UnsupportedBoundaryError, match="FFN"):
                memfit.apply(model, Combination(Backend.TORCH_FFN).config(), adapter=self.adapter)

    # -- remove() ----------------------------------------------------------------------------------------------------

    def test_remove_restores_model(self, model: nn.Module, inputs: dict[str, Any]) -> None:
        keys = list(model.state_dict().keys())
        attrs = [(m, dict(m.__dict__)) for m in model.modules()]
        config = getattr(model, "config", None)
        config_before = _config_state(config)
        switch = self.adapter.model_checkpoint_switch
        names = ("gradient_checkpointing", "_gradient_checkpointing_func") + (
            (switch.attribute,) if switch else ()
        )
        with torch.no_grad():
            before = model(**inputs)
        for combo in claimed_combinations(self.adapter, intervals=(2,)):
            handle = self.apply(model, combo.config())
            handle.remove()
            assert list(model.state_dict().keys()) == keys
            for module, snapshot in attrs:
                assert module.__dict__.keys() == snapshot.keys(), (
                    f"{combo}: attributes of {type(module).__name__} changed"
                )
                for hooks in ("_forward_hooks", "_forward_pre_hooks"):
                    assert len(module.__dict__[hooks]) == len(snapshot[hooks]), (
                        f"{combo}: a hook was left behind"
                    )
                for name in names:
                    assert module.__dict__.get(name) is snapshot.get(name), f"{combo}: {name} not restored"
            assert _config_state(config) == config_before, f"{combo}: the model's config was not restored"
        with torch.no_grad():
            after = model(**inputs)
        before_leaves, after_leaves = output_tensors(before), output_tensors(after)
        assert len(before_leaves) == len(after_leaves) > 0
        assert all(torch.equal(a, b) for a, b in zip(before_leaves, after_leaves, strict=True))

    # -- GPU: real peak memory and bf16 equivalence ---------------------------------------------------------------

    @pytest.mark.gpu
    def test_gpu_peak_memory_drops(self) -> None:
        require_cuda()
        from torch.nn.attention import SDPBackend, sdpa_kernel

        model = self.build_model(device="cuda", dtype=torch.bfloat16)
        preset = self.adapter.presets[self.preset]
        inputs = preset.inputs(model, tokens=self.gpu_tokens, generator=torch.Generator().manual_seed(0))
        combos = [
            c
            for c in claimed_combinations(self.adapter, intervals=(1, 2))
            if c.stride is None and c.backend is not None
        ]
        # Peak memory: frozen base weights (the LoRA case), where activations dominate the peak.
        # Equivalence: all weights trainable, so every parameter gradient is compared too.
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            self._step(model, inputs, "frozen")  # warm-up: lazy cuBLAS/allocator set-up is not a mode's cost
            base = {regime: self._step(model, inputs, regime) for regime in ("frozen", "full")}
            frozen = [(c, self._step_with(model, inputs, c.config(), "frozen")[0]) for c in combos]
            full = [(c, self._step_with(model, inputs, c.config(), "full")[0]) for c in combos]
        base_peak = base["frozen"].peak_bytes
        for combo, result in frozen:
            assert result.peak_bytes is not None and base_peak is not None
            # Held bytes on the GPU must drop for every mode.
            assert result.held_bytes < base["frozen"].held_bytes, (
                f"{combo}: holds {result.held_bytes} bytes on the GPU for backward, the unmodified model "
                f"{base['frozen'].held_bytes}: this mode saves nothing"
            )
            if combo.backend is not None and not combo.backend.ffn_only:
                # Whole-block modes: the peak itself must drop.
                assert result.peak_bytes < base_peak, (
                    f"{combo}: peak {result.peak_bytes} is not below the unmodified peak {base_peak}"
                )
            else:
                # Sub-block modes: at the tiny preset's widths one FFN's activations can be smaller than the
                # attention backward's own workspace, which then sets the peak; the peak must not rise
                # (beyond 3%: the recompute's and reload's transients), and the real-size benchmarks show
                # the drop.
                assert result.peak_bytes <= base_peak * 1.03, (
                    f"{combo}: peak {result.peak_bytes} rose above the unmodified peak {base_peak}"
                )
        for combo, result in full:
            assert_same_step(
                base["full"],
                result,
                what=f"{self.adapter.name} {combo} bf16 cuda",
                rtol=self.gpu_rtol,
                atol=self.gpu_atol,
            )

    # -- expectations derived from the declarations (independent of the engine) -------------------------------------

    def expected_frames(self, model: nn.Module, combo: Combination) -> int:
        interval = combo.interval if (self.adapter.supports_interval or combo.backend.ffn_only) else 1
        step = combo.stride or interval
        total = 0
        for blocks in self.adapter.resolve_block_lists(model).values():
            starts = range(0, len(blocks), step)
            if combo.backend.ffn_only:
                for s in starts:
                    for i in range(s, min(s + interval, len(blocks))):
                        total += len(self.adapter.spec_for(blocks[i]).ffn)
            else:
                total += len(starts)
        return total

    def expected_calls(self, model: nn.Module, combo: Combination) -> int:
        interval = combo.interval if (self.adapter.supports_interval or combo.backend.ffn_only) else 1
        step = combo.stride or interval
        total = 0
        for blocks in self.adapter.resolve_block_lists(model).values():
            for s in range(0, len(blocks), step):
                for i in range(s, min(s + interval, len(blocks))):
                    if combo.backend.ffn_only:
                        total += sum(len(r) for r in self.adapter.spec_for(blocks[i]).ffn)
                    else:
                        total += 1
        return total


def _config_state(config: Any) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """A model config's items and attributes (diffusers' FrozenDict has both), by identity of the values."""
    if config is None:
        return None
    items = {k: id(v) for k, v in config.items()} if isinstance(config, dict) else {}
    attributes = {k: id(v) for k, v in vars(config).items()} if hasattr(config, "__dict__") else {}
    return items, attributes
