"""A model that starts where it does not train (``memfit.apply(..., device=)``), on CPU.

On a CPU machine the only device is the CPU, so the move itself (a CPU model trained on a GPU) is
``test_gpu_weights.py``'s. Here: ``device`` is validated and changes nothing where the model already is; a failed
placement leaves the model as it was; the host check counts the weights that leave the CPU; a block called inside
its own call shares its upload; ``auto``'s profile reads the same with weights streaming as without; and ``auto``
on a card too small for the weights profiles with the planner's streaming set and trains bit for bit.
"""

from __future__ import annotations

import pytest
import torch

import memfit
import memfit.engine.state
from memfit import ConfigError, HostMemoryError, NotAvailableError
from memfit.auto import budget_planner
from memfit.auto.profile import profile_model
from memfit.offload.weights import WeightStreamer
from memfit.placement import Placement

from helpers import assert_same, frozen_toy, step
from toy import TOY

ON = {"gradient_checkpointing": True}
KEY = "gradient_checkpointing_stream_blocks"
AUTO = {**ON, "gradient_checkpointing_backend": "auto"}


def apply(model, config, **kw):
    return memfit.apply(model, config, adapter=TOY, **kw)


def _streaming(model, count):
    streamer = WeightStreamer(model, [(f"blocks.{i}", model.blocks[i]) for i in range(count)])
    streamer.install()
    return streamer


@pytest.mark.parametrize(
    ("device", "error", "message"),
    [
        ("xla", ConfigError, "memfit trains on 'cuda' or 'cpu', not 'xla'"),
        ("tpu", ConfigError, "not a device"),
        ("cuda:99", NotAvailableError, "this process sees"),
    ],
)
def test_a_device_memfit_cannot_train_on_is_refused_before_anything_is_touched(device, error, message):
    model = frozen_toy()
    with pytest.raises(error, match=message):
        apply(model, {**ON, KEY: 2}, device=device)
    assert not any(m._forward_pre_hooks for m in model.modules())
    with apply(model, {**ON, KEY: 2}):  # nothing half-applied
        pass


def test_a_model_apply_cannot_move_tensor_by_tensor_is_refused_when_a_device_is_given(monkeypatch):
    from memfit import placement

    model = frozen_toy()
    model.blocks[2].ff_out.register_buffer("scale", torch.empty(3, device="meta"))
    with pytest.raises(
        ConfigError, match=r"blocks\.2\.ff_out\.scale is on the meta device .* Load the weights"
    ):
        apply(model, {**ON, KEY: 2}, device="cpu")
    del model.blocks[2].ff_out.scale
    monkeypatch.setattr(placement, "is_fsdp_module", lambda m: m is model.blocks[0])
    with pytest.raises(NotAvailableError, match="sharded with FSDP2 .* Leave device out"):
        apply(model, {**ON}, device="cpu")
    assert not any(m._forward_pre_hooks for m in model.modules())


def test_the_device_the_model_is_on_already_moves_nothing_and_gives_the_same_gradients(x):
    model = frozen_toy()
    params = dict(model.named_parameters())
    values = {n: p.detach().clone() for n, p in params.items()}
    ref = step(model, x)
    with apply(model, {**ON, KEY: 3}, device="cpu") as handle:
        placement = handle._controller.placement
        assert (
            placement is not None and placement.parameters
        )  # the streamed weights, recorded with their home
        assert all(memfit.engine.state.is_streamed(p) for p, _ in placement.parameters)
        described = handle.describe()
        assert (
            "placed on cpu by apply" in described
            and "weights streamed from host memory: 3 block(s)" in described
        )
        assert_same(ref, step(model, x))
    assert dict(model.named_parameters()) == params
    assert all(torch.equal(p, values[n]) for n, p in params.items())


def test_what_stays_on_the_device_not_fitting_leaves_the_model_as_it_was(monkeypatch, x):
    def out_of_memory(model, device, *, profiles=False, streamed=None):
        raise memfit.DeviceMemoryError(f"does not fit on {device} (profiles={profiles})")

    monkeypatch.setattr(Placement, "move", staticmethod(out_of_memory))
    model = frozen_toy()
    ref = step(model, x)
    values = {n: p.detach().clone() for n, p in model.named_parameters()}
    config = {**ON, "gradient_checkpointing_backend": "torch", KEY: 3}
    with pytest.raises(memfit.DeviceMemoryError, match="profiles=False"):
        apply(model, config, device="cpu")
    assert all(torch.equal(p, values[n]) and p.is_contiguous() for n, p in model.named_parameters())
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
    assert_same(ref, step(model, x))
    with apply(model, {**ON, KEY: 3}):  # memfit is not left applied
        assert_same(ref, step(model, x))


def test_host_memory_counts_the_weights_a_cpu_model_gives_back_as_they_stream():
    # a CPU model streamed for a GPU frees its CPU weights block by block as their masters fill: they count as
    # free, less one block's buffer; a model already on the device frees no host memory
    model = frozen_toy()
    streamer = WeightStreamer(model, [(f"blocks.{i}", model.blocks[i]) for i in range(3)])
    need = sum(b.nbytes for b in streamer.blocks)
    payload = sum(b.payload for b in streamer.blocks)
    largest = max(b.nbytes for b in streamer.blocks)
    streamer.device = torch.device("cuda")  # where it would train (nothing is uploaded here)
    room = need - (payload - largest)
    streamer._available = lambda: room
    streamer._reserve = 0
    streamer._check_host_memory(streamer.blocks)
    streamer._available = lambda: room - 1
    with pytest.raises(HostMemoryError, match="plus .* the weights free as they leave the CPU"):
        streamer._check_host_memory(streamer.blocks)
    streamer.device = torch.device("cpu")
    streamer._available = lambda: need - 1
    with pytest.raises(HostMemoryError, match=r"need .* but .* is available and"):
        streamer._check_host_memory(streamer.blocks)


def test_a_block_called_inside_its_own_call_shares_its_upload(x):
    """A profiler measuring a block alone calls it from inside its own call (``memfit.auto.blockpeak``): the inner
    call uses the weights in place and leaves them there for the rest of the outer call."""
    model = frozen_toy()
    with torch.no_grad():
        expected = model(x, None)
    streamer = _streaming(model, 3)
    inner: list[torch.Tensor] = []
    calls = []

    def measure_alone(module, args):
        if not calls:
            calls.append(module)
            inner.append(module(*args))

    handle = model.blocks[1].register_forward_pre_hook(measure_alone)
    try:
        with torch.no_grad():
            out = model(x, None)
    finally:
        handle.remove()
        streamer.remove()
    assert torch.equal(out, expected) and not torch.isnan(inner[0]).any()
    assert streamer.stats.uploads == 3  # one per streamed block: the inner call made none


def test_the_profile_reads_the_same_with_weights_streaming(x):
    """``auto``'s profile of a model whose blocks stream (a card that cannot hold every weight) equals the profile
    of the model with every weight in place: a saved weight is a view of its upload, still not an activation."""
    model = frozen_toy()

    def profile():
        return profile_model(model, TOY, (x, None), {}, min_offload_bytes=0, copy_bytes_per_second=None)

    resident = profile()
    streamer = _streaming(model, 4)
    try:
        with streamer.profiling():
            streaming = profile()
        assert streamer.stats.uploads > 0 and not streamer._pending
    finally:
        streamer.remove()
    keys = ("saved_bytes", "input_bytes", "ffn_saved_bytes", "ffn_input_bytes", "attention_bytes", "flops")
    keys += (
        "frozen_bytes",
    )  # a streamed block's weights count as they will stream: the planner's candidates
    for a, b in zip(resident.blocks, streaming.blocks, strict=True):
        assert {k: getattr(a, k) for k in keys} == {k: getattr(b, k) for k in keys}
    assert resident.outside_bytes == streaming.outside_bytes


def test_auto_on_a_card_too_small_for_the_weights_profiles_them_streaming_and_trains_exactly(monkeypatch, x):
    """Where the weights exceed the planner's share of the card, ``apply(..., device=)`` under ``auto`` streams
    the planner's profiling set from the host before moving the rest, and the first forward is profiled with it
    streaming (no round trip of every weight through the device); the steps are the model's own."""
    model = frozen_toy()
    ref = step(model, x)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    card = weights  # the weights fill the card: half of it is the profile's resident share
    monkeypatch.setattr(budget_planner, "device_capacity", lambda device: card)
    profiled_streaming = []
    real_profile = budget_planner.profile_model

    def recording_profile(model, *args, **kw):
        profiled_streaming.append(any(memfit.engine.state.is_streamed(p) for p in model.parameters()))
        return real_profile(model, *args, **kw)

    monkeypatch.setattr(budget_planner, "profile_model", recording_profile)
    budget = {**AUTO, "gradient_checkpointing_memory_budget": 1 << 40}
    with apply(model, budget, device="cpu") as handle:
        controller = handle._controller
        assert controller.profiles_streaming
        streamed = controller.installation.streamer.streamed_bytes
        assert streamed >= weights - card // 2
        monkeypatch.setattr(
            budget_planner, "device_capacity", lambda device: None
        )  # plan as on CPU from here
        for _ in range(2):
            assert_same(ref, step(model, x))
    assert profiled_streaming == [True]
    assert_same(ref, step(model, x))


def test_auto_on_a_card_that_holds_the_weights_moves_them_whole(monkeypatch, x):
    model = frozen_toy()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    monkeypatch.setattr(budget_planner, "device_capacity", lambda device: 2 * weights)
    with apply(model, {**AUTO, "gradient_checkpointing_memory_budget": 1 << 40}, device="cpu") as handle:
        assert not handle._controller.profiles_streaming
        assert handle._controller.installation.streamer is None


@pytest.mark.parametrize("count", [1, 3, 7])
def test_the_profile_of_a_peft_flux_reads_the_same_with_any_set_streaming(count):
    peft = pytest.importorskip("peft")
    memfit_flux = pytest.importorskip("memfit_flux")
    adapter = memfit_flux.ADAPTER
    preset = adapter.presets["tiny"]
    torch.manual_seed(0)
    model = preset.build(dtype=torch.float32, device="cpu")
    model.requires_grad_(False)
    model.add_adapter(peft.LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    batch = preset.inputs(model, tokens=32, generator=torch.Generator().manual_seed(1))

    def profile():
        return profile_model(model, adapter, (), batch, min_offload_bytes=0, copy_bytes_per_second=None)

    resident = profile()
    blocks = [(f"{path}.{i}", block) for path, i, block in adapter.iter_blocks(model)]
    streamer = WeightStreamer(model, blocks[:count])
    streamer.install()
    try:
        with streamer.profiling():
            streaming = profile()
    finally:
        streamer.remove()
    assert [b.saved_bytes for b in streaming.blocks] == [b.saved_bytes for b in resident.blocks]
    assert [b.input_bytes for b in streaming.blocks] == [b.input_bytes for b in resident.blocks]
    assert [b.attention_bytes for b in streaming.blocks] == [b.attention_bytes for b in resident.blocks]
    assert [b.flops for b in streaming.blocks] == [b.flops for b in resident.blocks]
    assert [b.frozen_bytes for b in streaming.blocks] == [b.frozen_bytes for b in resident.blocks]
    assert streaming.outside_bytes == resident.outside_bytes


def test_undo_sends_home_what_apply_moved_what_was_added_since_and_weights_that_stopped_streaming(
    monkeypatch,
):
    """Placement's own bookkeeping on one device, its moves recorded instead of made (a home elsewhere cannot
    exist on a CPU machine): a recorded weight goes home whether or not it moved (a streamed one that a later plan
    put on the device), a tensor added on the device since goes where everything came from, one on the device
    before stays."""
    from memfit import placement as placement_mod

    model = frozen_toy()
    elsewhere = torch.device("cuda", 7)  # a stand-in home, never touched
    streamed = model.blocks[1].ff_in.weight
    moves = []
    monkeypatch.setattr(placement_mod, "_move_parameter", lambda p, device: moves.append((p, device)))
    placement = Placement.move(model, torch.device("cpu"), streamed={id(streamed): elsewhere})
    assert moves == [] and [id(p) for p, _ in placement.parameters] == [id(streamed)]
    late = torch.nn.Parameter(torch.zeros(2))  # added on the device after the move (LoRA after apply)
    model.blocks[2].register_parameter("late", late)
    placement.undo()
    assert [(id(p), device) for p, device in moves] == [(id(streamed), elsewhere), (id(late), elsewhere)]
