"""Streamed blocks that are not recomputed whole ("Saved weights" in ``memfit.offload.weights``): their forward saves
references to their uploaded weights, not the weights, so the upload is freed after the forward and uploaded again
for backward; a region recomputed inside such a block runs on that upload. Gradients stay bitwise equal to the
unmodified model's, on the synchronous copy engine."""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch
from test_weights import streamer_of

import memfit
from memfit.auto import BlockPolicy
from memfit.offload.weights import WeightStreamer
from memfit_conformance.base import cpu_copy_engine

from helpers import auto_config, every_streamed_policy, force_auto_plan

memfit_flux = pytest.importorskip("memfit_flux")
peft = pytest.importorskip("peft")
ADAPTER = memfit_flux.ADAPTER
TINY = ADAPTER.presets["tiny"]
LORA = ["to_q", "to_k", "to_v", "to_out.0", "proj_mlp", "proj_out", "ff.net.2"]


def lora_model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = TINY.build(dtype=torch.float32, device="cpu").requires_grad_(False)
    model.add_adapter(peft.LoraConfig(r=4, target_modules=LORA, init_lora_weights=False))
    return model


def batch(model):
    return TINY.inputs(model, tokens=64, generator=torch.Generator().manual_seed(1))


def train_step(model, inputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = ADAPTER.loss(model(**inputs))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_every_policy_on_streamed_blocks_gives_the_unmodified_gradients_bitwise(monkeypatch):
    model = lora_model()
    inputs = batch(model)
    ref = train_step(model, inputs)
    force_auto_plan(monkeypatch, every_streamed_policy, lambda names: names)  # every block streams
    with memfit.apply(
        model, auto_config("1GiB"), copy_engine=cpu_copy_engine(), min_offload_bytes=0
    ) as handle:
        for _ in range(3):  # the first step profiles and plans; later ones run on the uploads issued ahead
            loss, grads = train_step(model, inputs)
            assert torch.equal(loss, ref[0])
            assert grads.keys() == ref[1].keys()
            for name in grads:
                assert torch.equal(grads[name], ref[1][name]), name
        stats = handle.stats()
        streamer = streamer_of(handle)
        referenced = [b for b in streamer.blocks if b.referenced]
        # every block but the whole-block recomputed ones saves references
        assert len(referenced) == sum(
            p.recompute != "block" for p in every_streamed_policy([b.name for b in streamer.blocks])
        )
        assert streamer.stats.weights_referenced > 0
    assert stats["weight_held_after_forward"] == 0
    assert stats["block_calls_parked"] > 0  # parked streamed blocks ran
    # nothing is on demand but a backward's first upload of the first step (the profile had none ahead)
    assert stats["weight_uploads_on_demand"] <= 1


def test_a_referenced_block_s_upload_is_freed_after_its_forward_and_back_for_its_backward(monkeypatch):
    model = lora_model()
    inputs = batch(model)
    force_auto_plan(monkeypatch, lambda names: [BlockPolicy.FFN] * len(names), lambda names: names[:3])
    with memfit.apply(model, auto_config("1GiB")) as handle:
        train_step(model, inputs)  # profile and plan
        streamer = streamer_of(handle)
        assert [b.referenced for b in streamer.blocks] == [True] * 3
        seen_backward = []
        hooks = [
            b.module.register_full_backward_pre_hook(
                lambda m, g, name=b.name: seen_backward.append((name, streamer.alive()))
            )
            for b in streamer.blocks
        ]
        loss = ADAPTER.loss(model(**inputs))
        gc.collect()
        # the forward returned: no upload is held by what it saved; the last streamed block's is issued for
        # the backward that reaches it first
        assert streamer.alive() == [streamer.blocks[-1].name]
        loss.backward()
        for h in hooks:
            h.remove()
        gc.collect()
        assert streamer.alive() == []  # the backward's end let the last upload go
        assert handle.stats()["weight_held_after_forward"] == 0  # nothing the forward saved held its upload
    names = [b.name for b in streamer.blocks]
    # each block's backward runs on its upload, the one before it issued ahead
    assert [name for name, _ in seen_backward] == names[::-1]
    for name, alive in seen_backward:
        assert name in alive and len(alive) <= 2


@pytest.mark.parametrize("policy", [BlockPolicy.KEEP, BlockPolicy.FFN])
def test_two_uploads_at_most_are_alive_in_backward(monkeypatch, policy):
    """Every block streams and holds its backward's upload until backward reaches the block before: the upload of
    that block, issued as the first gradient reaches the block after it, comes after that one is let go of (two
    alive, as the peak model counts: its own and the one ahead, never three)."""
    model = lora_model()
    inputs = batch(model)
    ref = train_step(model, inputs)
    force_auto_plan(monkeypatch, lambda names: [policy] * len(names), lambda names: names)
    with memfit.apply(model, auto_config("1GiB")) as handle:
        train_step(model, inputs)  # profile and plan
        streamer = streamer_of(handle)
        assert all(b.referenced for b in streamer.blocks)
        streamer.reset_stats()
        loss, grads = train_step(model, inputs)
        assert torch.equal(loss, ref[0]) and all(torch.equal(grads[n], ref[1][n]) for n in ref[1])
        assert streamer.stats.max_alive == 2


def test_remove_restores_the_weights_exactly(monkeypatch):
    model = lora_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    force_auto_plan(monkeypatch, every_streamed_policy, lambda names: names[::2])
    with memfit.apply(model, auto_config("1GiB"), copy_engine=cpu_copy_engine(), min_offload_bytes=0):
        train_step(model, batch(model))
    after = model.state_dict()
    assert after.keys() == before.keys()
    for key in before:
        assert torch.equal(after[key], before[key]), key


def test_the_next_step_after_an_interrupt_inside_a_referenced_block_is_exact(monkeypatch):
    """A KeyboardInterrupt inside a streamed block's forward skips its post-hook: the next forward puts its weights
    back to their placeholders and closes its saving scope (with the thread's other open calls)."""
    model = lora_model()
    inputs = batch(model)
    ref = train_step(model, inputs)
    force_auto_plan(monkeypatch, lambda names: [BlockPolicy.KEEP] * len(names), lambda names: names)
    with memfit.apply(model, auto_config("1GiB")) as handle:
        train_step(model, inputs)  # profile and plan
        assert all(b.referenced for b in streamer_of(handle).blocks)
        fired = []

        def interrupt(module, args):
            if not fired:
                fired.append(1)
                raise KeyboardInterrupt

        hook = model.transformer_blocks[1].attn.register_forward_pre_hook(interrupt)
        with pytest.raises(KeyboardInterrupt):
            train_step(model, inputs)
        hook.remove()
        for _ in range(2):
            loss, grads = train_step(model, inputs)
            assert torch.equal(loss, ref[0]) and all(torch.equal(grads[n], ref[1][n]) for n in ref[1])
        gc.collect()
        assert streamer_of(handle).alive() == []  # the interrupted block's upload did not stay behind
        assert handle.stats()["weight_held_after_forward"] == 0
    linear = torch.nn.Linear(4, 4)
    linear(torch.randn(2, 4, requires_grad=True)).sum().backward()  # the thread's autograd state is clean


def test_while_auto_profiles_a_referenced_block_saves_through_the_profile_s_hooks():
    """``auto`` profiles a new shape with the streamer's hooks on (a card that cannot hold the weights): its own
    saved-tensor hooks must see every tensor a streamed block saves, so the block's saving scope stays off."""
    from toy import build

    model = build(blocks=3).requires_grad_(False)
    streamer = WeightStreamer(model, [("blocks.1", model.blocks[1])])
    streamer.install()
    streamer.reference_saves([model.blocks[1]])
    x = torch.randn(2, 8, 16, requires_grad=True)
    try:
        for profiling, seen_inside in ((True, True), (False, False)):
            seen = []

            def pack(t, seen=seen):
                seen.append(t.untyped_storage().data_ptr())
                return t

            upload_ptrs: list[int] = []

            def note_upload(module, args, upload_ptrs=upload_ptrs):  # after the streamer's pre-hook
                upload_ptrs.append(streamer.upload_of(module).buffer.data_ptr())

            hook = model.blocks[1].register_forward_pre_hook(note_upload)
            with (
                streamer.profiling() if profiling else contextlib.nullcontext(),
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
            ):
                streamer.begin_forward()
                model(x)
                streamer.end_forward(failed=False)
            hook.remove()
            # the block's weights were saved through the outer hooks only while profiling
            assert (upload_ptrs[0] in seen) is seen_inside, profiling
    finally:
        streamer.remove()
