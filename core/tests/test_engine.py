"""Region engine semantics on a toy stack (no diffusers): replay, chaining, safety checks, removal."""

from __future__ import annotations

import warnings

import pytest
import torch

import memfit
from memfit import MemfitError, MemfitWarning, NotAvailableError, SavedBytesMeter

from helpers import assert_same, step
from toy import TOY, ToyModel, build, loss_of

ON = {"gradient_checkpointing": True}


@pytest.mark.parametrize("backend", ["torch", "torch-ffn"])
@pytest.mark.parametrize(("interval", "stride"), [(1, None), (2, None), (3, 3), (2, 5), (6, None)])
def test_hooks_entry_matches_reference(model, x, backend, interval, stride):
    ref = step(model, x)
    cfg = {
        **ON,
        "gradient_checkpointing_backend": backend,
        "gradient_checkpointing_interval": interval,
        "gradient_checkpointing_segment_stride": stride,
    }
    if stride is None:
        del cfg["gradient_checkpointing_segment_stride"]
    with memfit.apply(model, cfg, adapter=TOY) as handle:
        assert_same(ref, step(model, x))
        stats = handle.stats()
    assert stats["frames"] == stats["recomputes"] > 0


def test_dropout_rng_is_replayed(x):
    model = build(dropout=0.3)
    torch.manual_seed(123)
    ref = step(model, x)
    with memfit.apply(model, {**ON, "gradient_checkpointing_interval": 2}, adapter=TOY):
        torch.manual_seed(123)
        got = step(model, x)
        after = torch.rand(())
    torch.manual_seed(123)
    step(model, x)
    # the recompute used the forward's random numbers and did not disturb the caller's RNG stream
    assert_same(ref, got)
    assert torch.equal(after, torch.rand(()))


def test_autocast_state_is_replayed(model, x):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = step(model, x)
    with memfit.apply(model, ON, adapter=TOY), torch.autocast("cpu", dtype=torch.bfloat16):
        got = step(model, x)
    assert_same(ref, got)


def _autocast_forward_plain_backward(model, x):
    """Forward under bf16 autocast, backward outside it: the recompute must enter the forward's autocast."""
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = loss_of(model(x, None))
    loss.backward()
    return loss.detach(), x.grad.clone(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("backend", ["torch", "torch-ffn"])
def test_autocast_of_the_forward_is_replayed_in_a_backward_outside_it(model, x, backend):
    ref = _autocast_forward_plain_backward(model, x)
    with memfit.apply(model, {**ON, "gradient_checkpointing_backend": backend}, adapter=TOY) as handle:
        got = _autocast_forward_plain_backward(model, x)
        assert handle.stats()["recomputes"] > 0
        assert not torch.is_autocast_enabled("cpu")  # the caller's state is back after the recomputes
    assert_same(ref, got)


def test_retained_graph_recomputes_again(model, x):
    ref = step(model, x, retain=True, backwards=2)
    with memfit.apply(model, {**ON, "gradient_checkpointing_interval": 3}, adapter=TOY) as handle:
        got = step(model, x, retain=True, backwards=2)
        assert handle.stats()["recomputes"] == 2 * handle.stats()["frames"]
    assert_same(ref, got)


def test_only_some_inputs_require_grad(model, x):
    for p in model.parameters():
        p.requires_grad_(False)
    for p in model.blocks[2].ff_in.parameters():  # a LoRA-like trainable island
        p.requires_grad_(True)
    ref = step(model, x)
    for backend in ("torch", "torch-ffn"):
        with memfit.apply(model, {**ON, "gradient_checkpointing_backend": backend}, adapter=TOY):
            assert_same(ref, step(model, x))


def test_chunk_keeps_one_entry_set(model, x):
    with memfit.apply(model, ON, adapter=TOY) as h1:
        step(model, x)
        per_block = h1.stats()
    with memfit.apply(model, {**ON, "gradient_checkpointing_interval": 3}, adapter=TOY) as h3:
        step(model, x)
        per_chunk = h3.stats()
    # each frame keeps the hidden state entering it and the shared `scale`: 2 entries per frame
    assert per_block["frames"] == 6 and per_block["entries"] == 12
    assert per_chunk["frames"] == 2 and per_chunk["entries"] == 4


def test_residual_between_blocks_becomes_an_entry(model, x):
    residuals = [torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(i)) for i in range(6)]
    for r in residuals:
        r.requires_grad_(True)
    ref = step(model, x, residuals=residuals)
    ref_res = [r.grad.clone() for r in residuals]
    for r in residuals:
        r.grad = None
    with memfit.apply(model, {**ON, "gradient_checkpointing_interval": 2}, adapter=TOY) as handle:
        got = step(model, x, residuals=residuals)
        stats = handle.stats()
    assert_same(ref, got)
    assert all(torch.equal(a, r.grad) for a, r in zip(ref_res, residuals, strict=True))
    # the edited hidden state cannot chain: each block after an edit keeps its own input
    assert stats["frames"] == 3 and stats["entries"] == 3 * 2 + 3


def test_entry_edited_after_forward_is_detected(model):
    with memfit.apply(model, ON, adapter=TOY):
        inp = torch.randn(2, 8, 16, requires_grad=True) * 1.0
        out = model.blocks[0](inp, torch.tensor(0.5))  # the block's hooks record one frame
        with torch.no_grad():
            inp.add_(1.0)  # edit the frame's entry after it was recorded
        with pytest.raises(MemfitError, match="modified in place after the region ran"):
            loss_of(out).backward()


def test_module_editing_its_input_in_place_is_refused(x):
    model = build()
    model.blocks[1].edit_input = True
    with (
        memfit.apply(model, ON, adapter=TOY),
        pytest.raises(MemfitError, match="modified one of its inputs in place"),
    ):
        step(model, x)


def test_exception_mid_forward_leaves_engine_usable(model, x):
    ref = step(model, x)
    with memfit.apply(model, {**ON, "gradient_checkpointing_interval": 2}, adapter=TOY):
        model.blocks[3].fail = True
        with pytest.raises(RuntimeError, match="planted failure"):
            step(model, x)
        model.blocks[3].fail = False
        assert_same(ref, step(model, x))


def test_no_grad_records_nothing(model, x):
    with memfit.apply(model, ON, adapter=TOY) as handle, torch.no_grad():
        model(x)
    assert handle.stats()["frames"] == 0


def test_disabled_installs_nothing(model, x):
    hooks_before = sum(len(m._forward_pre_hooks) for m in model.modules())
    with memfit.apply(model, {"gradient_checkpointing": False}, adapter=TOY) as handle:
        step(model, x)
        assert handle.stats()["frames"] == 0
        assert (
            sum(len(m._forward_pre_hooks) for m in model.modules()) == hooks_before + 1
        )  # the model hook only


def test_apply_twice_is_refused_and_remove_is_idempotent(model):
    handle = memfit.apply(model, ON, adapter=TOY)
    with pytest.raises(MemfitError, match="already applied"):
        memfit.apply(model, ON, adapter=TOY)
    handle.remove()
    handle.remove()
    memfit.apply(model, ON, adapter=TOY).remove()


def test_remove_restores_hooks_and_forward(model, x):
    before = model(x)
    n_hooks = [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()]
    memfit.apply(model, {**ON, "gradient_checkpointing_backend": "torch-ffn"}, adapter=TOY).remove()
    assert n_hooks == [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()]
    assert torch.equal(before, model(x))


@pytest.mark.parametrize("backend", ["unsloth", "unsloth-ffn"])
def test_offload_backends_need_cuda_and_never_fall_back(model, backend):
    with pytest.raises(NotAvailableError, match=f"'{backend}' parks activations.*CUDA"):
        memfit.apply(model, {**ON, "gradient_checkpointing_backend": backend}, adapter=TOY)


def test_offload_attention_needs_cuda(model):
    with pytest.raises(NotAvailableError, match="offload_attention parks activations.*CUDA"):
        memfit.apply(model, {"gradient_checkpointing_offload_attention": True}, adapter=TOY)


def test_model_without_adapter_or_diffusers_support_is_refused():
    with pytest.raises(MemfitError, match="no memfit adapter"):
        memfit.apply(ToyModel(), ON)


def test_fsdp_checkpointing_disables_model_level_checkpointing(model, x):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model.blocks[0] = checkpoint_wrapper(model.blocks[0])
    with pytest.warns(MemfitWarning, match="FSDP activation checkpointing") as record:
        handle = memfit.apply(model, ON, adapter=TOY)
    assert len(record) == 1
    with handle:
        step(model, x)
        assert handle.stats()["frames"] == 0


def test_interval_warns_once_for_family_without_interval(model, x):
    import dataclasses

    no_interval = dataclasses.replace(TOY, supports_interval=False)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        handle = memfit.apply(model, {**ON, "gradient_checkpointing_interval": 3}, adapter=no_interval)
        with handle:
            step(model, x)
            step(model, x)
            assert handle.stats()["frames"] == 12  # interval ignored: one frame per block, two steps
    assert [str(w.message) for w in record if issubclass(w.category, MemfitWarning)].__len__() == 1


def test_meter_counts_each_storage_once_and_skips_parameters():
    w = torch.nn.Parameter(torch.randn(4, 4))
    x = torch.randn(3, 4, requires_grad=True)
    with SavedBytesMeter(exclude=[w]) as meter:
        y = x @ w  # saves x (and w: excluded)
        z = (x[:2] * 2).sum() + y.sum()  # a view of x: same storage
    assert meter.device_bytes == x.untyped_storage().nbytes()
    z.backward()


def test_plain_call_arguments_flatten_as_pytree_does():
    """The frame's shortcut for calls of plain tensors/None (and tensor outputs) gives pytree's leaves, in its order,
    and rebuilds the same call; anything else goes through pytree."""
    from torch.utils._pytree import tree_flatten

    from memfit.engine.frame import _flatten_call, _flatten_output, _unflatten_call

    a, b = torch.randn(2), torch.randn(3)
    calls = [((a, b), {}), ((a,), {"emb": b, "mask": None}), ((a, 2), {}), ((a,), {"rope": (a, b)}), ((), {})]
    for args, kwargs in calls:
        flat, spec = _flatten_call(args, kwargs)
        assert [id(v) for v in flat] == [id(v) for v in tree_flatten((args, kwargs))[0]]
        again, again_kwargs = _unflatten_call(flat, spec)
        assert type(again) is tuple and [id(v) for v in again] == [id(v) for v in args]
        assert list(again_kwargs) == list(kwargs)
        assert all(again_kwargs[k] is v or again_kwargs[k] == v for k, v in kwargs.items())
    for output in (a, (a, b), (a, None), [a], {"x": a}):
        assert [id(v) for v in _flatten_output(output)] == [id(v) for v in tree_flatten(output)[0]]


@pytest.mark.parametrize("backend", ["torch", "torch-ffn"])
def test_recompute_gets_the_input_object_the_forward_got_when_it_has_no_history(model, x, backend):
    # a model may cache host-side values on a tensor it hands every block (Mage-Flow's sample boundaries):
    # a recompute that got a detached alias instead would lose them and read the device again
    model.proj_in.bias.requires_grad_(False)  # the shared ``scale`` then has no autograd history
    seen: list[torch.Tensor] = []
    hook = model.blocks[2].register_forward_pre_hook(lambda module, args: seen.append(args[1]))
    try:
        ref = step(model, x)
        seen.clear()
        with memfit.apply(model, {**ON, "gradient_checkpointing_backend": backend}, adapter=TOY) as handle:
            assert_same(ref, step(model, x))
            recomputes = handle.stats()["recomputes"]
    finally:
        hook.remove()
    assert recomputes > 0
    if backend == "torch":  # the block is the region: called once in forward, once in its recompute
        assert len(seen) == 2
    assert all(s is seen[0] for s in seen) and not seen[0].requires_grad


def test_an_input_that_requires_grad_only_after_the_forward_is_recomputed_as_the_forward_saw_it(model, x):
    model.proj_in.bias.requires_grad_(False)
    ref = step(model, x)
    scales: list[torch.Tensor] = []
    hook = model.blocks[2].register_forward_pre_hook(lambda module, args: scales.append(args[1]))
    try:
        with memfit.apply(model, ON, adapter=TOY):
            model.zero_grad(set_to_none=True)
            xi = x.detach().clone().requires_grad_(True)
            loss = loss_of(model(xi))
            scales[0].requires_grad_(
                True
            )  # a leaf without history until now: the recompute must not follow it
            loss.backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    finally:
        hook.remove()
    assert scales[0].grad is None
    assert_same(ref, (loss.detach(), xi.grad.clone(), grads))
