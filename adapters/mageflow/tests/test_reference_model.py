"""The reference Mage-Flow transformer itself: packing, varlen attention, rotary layout, released geometry."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from memfit_mageflow import ADAPTER
from memfit_mageflow.model import (
    MageFlow,
    MageFlowEmbedRope,
    MageFlowTransformer2DModel,
    host_bounds,
    lengths_to_cu_seqlens,
    varlen_joint_attention,
)
from memfit_mageflow.presets import FULL, build_tiny, build_upstream_tiny

import memfit


@pytest.fixture(scope="module")
def model() -> MageFlowTransformer2DModel:
    return build_tiny(seed=1).eval()


def _sample(model: MageFlowTransformer2DModel, seed: int, grid: tuple[int, int], text_len: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    h, w = grid
    return dict(
        img=torch.randn(h * w, model.params.in_channels, generator=g),
        txt=torch.randn(text_len, model.params.context_in_dim, generator=g),
        sigma=torch.rand(1, generator=g),
        shape=(1, h, w),
    )


def _run(model: MageFlow, samples: list[dict]) -> list[torch.Tensor]:
    """Pack ``samples`` into one varlen forward; return each sample's output tokens."""
    img_lens = [s["img"].shape[0] for s in samples]
    out = model(
        hidden_states=torch.cat([s["img"] for s in samples])[None],
        encoder_hidden_states=torch.cat([s["txt"] for s in samples])[None],
        timestep=torch.cat([s["sigma"] for s in samples]),
        img_shapes=[s["shape"] for s in samples],
        img_cu_seqlens=lengths_to_cu_seqlens(img_lens),
        txt_cu_seqlens=lengths_to_cu_seqlens([s["txt"].shape[0] for s in samples]),
    )
    return list(out[0].split(img_lens))


@torch.no_grad()
def test_first_packed_sample_equals_running_it_alone(model):
    a = _sample(model, 0, (4, 6), 5)
    b = _sample(model, 1, (5, 3), 9)
    packed = _run(model, [a, b])
    alone = _run(model, [a])
    assert packed[0].shape == (24, model.params.out_channels)
    torch.testing.assert_close(packed[0], alone[0], rtol=1e-5, atol=1e-6)


@torch.no_grad()
def test_packed_samples_do_not_see_each_other(model):
    # Sample B sits at pack position 1 in both packs (same rotary frame coordinate); its neighbour
    # differs in content, resolution, prompt length and timestep. Attention, modulation and the
    # output norm must keep B's result unchanged.
    a = _sample(model, 0, (4, 6), 5)
    c = _sample(model, 2, (2, 9), 3)
    b = _sample(model, 1, (5, 3), 9)
    first = _run(model, [a, b])[1]
    second = _run(model, [c, b])[1]
    torch.testing.assert_close(first, second, rtol=1e-5, atol=1e-6)


@torch.no_grad()
def test_pack_position_sets_the_frame_coordinate(model):
    # Upstream behaviour, reproduced on purpose: the frame rotary coordinate of an image segment is its
    # index in the pack, so (text tokens being unrotated) the same sample at position 1 differs from
    # the same sample at position 0.
    a = _sample(model, 0, (4, 6), 5)
    b = _sample(model, 1, (5, 3), 9)
    assert not torch.allclose(_run(model, [a, b])[1], _run(model, [b])[0], atol=1e-4)


@torch.no_grad()
def test_equal_length_batch_equals_packed_form(model):
    a = _sample(model, 0, (4, 4), 6)
    b = _sample(model, 1, (4, 4), 6)
    packed = torch.cat(_run(model, [a, b]))
    batched = model(
        hidden_states=torch.stack([a["img"], b["img"]]),
        encoder_hidden_states=torch.stack([a["txt"], b["txt"]]),
        timestep=torch.cat([a["sigma"], b["sigma"]]),
        img_shapes=[a["shape"], b["shape"]],
    )
    assert batched.shape == (2, 16, model.params.out_channels)
    torch.testing.assert_close(batched.reshape(32, -1), packed)


def test_varlen_attention_equals_block_diagonal_mask():
    g = torch.Generator().manual_seed(0)
    heads, dim = 3, 8
    txt_lens, img_lens = [4, 1, 7], [6, 9, 2]

    def rand(n: int) -> torch.Tensor:
        return torch.randn(n, heads, dim, generator=g)

    tq, tk, tv = rand(sum(txt_lens)), rand(sum(txt_lens)), rand(sum(txt_lens))
    iq, ik, iv = rand(sum(img_lens)), rand(sum(img_lens)), rand(sum(img_lens))
    txt_out, img_out = varlen_joint_attention(
        tq, tk, tv, iq, ik, iv, lengths_to_cu_seqlens(txt_lens), lengths_to_cu_seqlens(img_lens)
    )

    # Independent formulation: one dense attention over [all text, all images] with a mask that only
    # lets tokens of the same sample see each other.
    txt_owner = torch.repeat_interleave(torch.arange(3), torch.tensor(txt_lens))
    img_owner = torch.repeat_interleave(torch.arange(3), torch.tensor(img_lens))
    owner = torch.cat([txt_owner, img_owner])
    mask = owner[:, None] == owner[None, :]
    q, k, v = (torch.cat(pair).transpose(0, 1) for pair in ((tq, iq), (tk, ik), (tv, iv)))
    dense = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(0, 1)
    torch.testing.assert_close(txt_out, dense[: sum(txt_lens)], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(img_out, dense[sum(txt_lens) :], rtol=1e-5, atol=1e-6)


def test_rotary_layout():
    rope = MageFlowEmbedRope(theta=10000, axes_dim=(4, 6, 6), scale_rope=True)
    freqs = rope([(1, 4, 6), (1, 3, 3)], torch.device("cpu"))
    assert freqs.shape == (24 + 9, 8) and freqs.is_complex()
    first = freqs[:24].reshape(4, 6, 8)
    # centred height/width: row 2 of 4 and column 3 of 6 are position 0 (no rotation)
    assert torch.equal(first[2, 3, 2:], torch.ones(6, dtype=torch.complex64))
    # frame coordinate = segment index: 0 for the first segment, 1 for the second
    assert torch.equal(first[..., :2], torch.ones(4, 6, 2, dtype=torch.complex64))
    assert not torch.allclose(freqs[24:, :2], torch.ones(9, 2, dtype=torch.complex64))
    # row 0 of 4 sits at height position -2: angle -2 * theta^0 on the first height frequency
    torch.testing.assert_close(torch.angle(first[0, 3, 2]), torch.tensor(-2.0))


def _train_step(model: MageFlow, samples: list[dict]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = torch.cat(_run(model, samples))
    out.pow(2).mean().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _switch_on(model: MageFlow) -> None:
    if isinstance(model, MageFlowTransformer2DModel):
        model.enable_gradient_checkpointing()  # the wrapper's way: attribute and config
    else:
        model.checkpoint = True  # upstream's: MageFlowParams(checkpoint=True) or the attribute


@pytest.mark.parametrize("build", [build_tiny, build_upstream_tiny], ids=["wrapper", "upstream"])
def test_own_checkpointing_matches_plain_backward(build, monkeypatch):
    model = build(seed=3)
    samples = [_sample(model, 4, (3, 5), 4), _sample(model, 5, (6, 2), 7)]
    plain_out, plain_grads = _train_step(model, samples)
    calls = []
    real = torch.utils.checkpoint.checkpoint
    monkeypatch.setattr(
        torch.utils.checkpoint, "checkpoint", lambda *a, **k: calls.append((a[0], k)) or real(*a, **k)
    )
    if isinstance(model, MageFlowTransformer2DModel):
        model._gradient_checkpointing_func = torch.utils.checkpoint.checkpoint  # the counting one
    _switch_on(model)
    ckpt_out, ckpt_grads = _train_step(model, samples)
    assert len(calls) == len(model.transformer_blocks)
    # the calling convention each real class has
    assert all(k == {"use_reentrant": False} for _, k in calls)
    blocks = [fn for fn, _ in calls]
    if isinstance(model, MageFlowTransformer2DModel):
        assert not any(isinstance(fn, torch.nn.Module) for fn in blocks)  # closures over the blocks
        assert (
            model.config.checkpoint is True and model.config["checkpoint"] is False
        )  # as the trainer's class
    else:
        assert blocks == list(model.transformer_blocks)
    torch.testing.assert_close(ckpt_out, plain_out, rtol=0, atol=0)
    assert len(ckpt_grads) == len(plain_grads)
    for x, y in zip(ckpt_grads, plain_grads, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


@pytest.mark.parametrize("checkpointing", ["none", "diffusers", "memfit"])
def test_a_training_step_reads_the_sample_boundaries_from_the_device_once_per_stream(
    checkpointing, monkeypatch
):
    # tolist() waits for the GPU: once per attention call (forward and recompute) left it idle between blocks
    model = build_tiny(seed=3)
    samples = [_sample(model, 4, (3, 5), 4), _sample(model, 5, (6, 2), 7)]
    plain_out, plain_grads = _train_step(model, samples)
    reads = []
    real = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t.dtype) or real(t))
    handle = None
    if checkpointing == "diffusers":
        model.enable_gradient_checkpointing()
    elif checkpointing == "memfit":
        handle = memfit.apply(model, {"gradient_checkpointing": True}, adapter=ADAPTER)
    try:
        out, grads = _train_step(model, samples)
        recomputes = handle.stats()["recomputes"] if handle is not None else None
    finally:
        if handle is not None:
            handle.remove()
    assert reads.count(torch.int32) == 2  # the image and the text boundaries, as the model packs them
    assert recomputes is None or recomputes > 0
    torch.testing.assert_close(out, plain_out, rtol=0, atol=0)
    for x, y in zip(grads, plain_grads, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_host_bounds_reads_the_device_again_after_an_in_place_edit():
    cu = lengths_to_cu_seqlens([3, 4])
    assert host_bounds(cu) == [0, 3, 7]
    cu[2] = 9
    assert host_bounds(cu) == [0, 3, 9]
    assert host_bounds(torch.tensor([0, 5], dtype=torch.int32)) == [0, 5]


def test_the_two_classes_are_one_model():
    wrapper, upstream = build_tiny(seed=2), build_upstream_tiny(seed=2)
    assert list(wrapper.state_dict()) == list(upstream.state_dict())
    assert all(
        torch.equal(a, b)
        for a, b in zip(wrapper.state_dict().values(), upstream.state_dict().values(), strict=True)
    )
    samples = [_sample(wrapper, 0, (4, 6), 5), _sample(wrapper, 1, (5, 3), 9)]
    with torch.no_grad():
        assert all(
            torch.equal(a, b) for a, b in zip(_run(wrapper, samples), _run(upstream, samples), strict=True)
        )
    assert isinstance(wrapper, MageFlow) and not hasattr(upstream, "config")


def test_last_block_text_stream_does_not_reach_the_output():
    # Architectural fact (all blocks are double-stream; the output reads the image stream only): the
    # last block's text MLP gets no gradient. memfit's FFN regions there are never recomputed.
    model = build_tiny(seed=0)
    a, b = _sample(model, 0, (4, 6), 5), _sample(model, 1, (5, 3), 9)
    torch.cat(_run(model, [a, b])).pow(2).mean().backward()
    last = model.transformer_blocks[-1]
    assert all(p.grad is None for p in last.txt_mlp.parameters())
    assert all(p.grad is not None for p in last.img_mlp.parameters())
    assert all(p.grad is not None for p in model.transformer_blocks[-2].txt_mlp.parameters())


def test_full_preset_is_the_released_layout():
    # Built on the meta device: no memory, no weights; checks the 4B geometry of the released
    # checkpoint (microsoft/Mage-Flow transformer/: 397 tensors).
    with torch.device("meta"):
        full = MageFlowTransformer2DModel(**FULL)
    state = full.state_dict()
    assert len(state) == 397
    assert len(full.transformer_blocks) == 12
    params = sum(p.numel() for p in full.parameters())
    assert 4.0e9 < params < 4.2e9, params
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    assert shapes["img_in.weight"] == (3072, 128)
    assert shapes["txt_norm.weight"] == (2560,)
    assert shapes["txt_in.weight"] == (3072, 2560)
    assert shapes["time_text_embed.timestep_embedder.linear_1.weight"] == (3072, 256)
    assert shapes["norm_out.linear.weight"] == (6144, 3072)
    assert shapes["proj_out.weight"] == (128, 3072)
    block = {k.split(".", 2)[2]: v for k, v in shapes.items() if k.startswith("transformer_blocks.11.")}
    assert block == {
        "img_mod.1.weight": (18432, 3072),
        "img_mod.1.bias": (18432,),
        "txt_mod.1.weight": (18432, 3072),
        "txt_mod.1.bias": (18432,),
        **{
            f"attn.{n}.weight": (3072, 3072)
            for n in (
                "to_q",
                "to_k",
                "to_v",
                "add_q_proj",
                "add_k_proj",
                "add_v_proj",
                "to_out.0",
                "to_add_out",
            )
        },
        **{
            f"attn.{n}.bias": (3072,)
            for n in (
                "to_q",
                "to_k",
                "to_v",
                "add_q_proj",
                "add_k_proj",
                "add_v_proj",
                "to_out.0",
                "to_add_out",
            )
        },
        **{f"attn.{n}.weight": (128,) for n in ("norm_q", "norm_k", "norm_added_q", "norm_added_k")},
        **{f"{s}_mlp.net.0.proj.weight": (12288, 3072) for s in ("img", "txt")},
        **{f"{s}_mlp.net.0.proj.bias": (12288,) for s in ("img", "txt")},
        **{f"{s}_mlp.net.2.weight": (3072, 12288) for s in ("img", "txt")},
        **{f"{s}_mlp.net.2.bias": (3072,) for s in ("img", "txt")},
    }


def test_released_config_loads():
    # transformer/config.json as published carries extra (unused) keys; they are ignored.
    released = dict(
        FULL,
        vec_in_dim=0,
        depth_single_blocks=0,
        qkv_bias=True,
        guidance_embed=False,
        checkpoint=False,
        rope_type="msrope",
        time_type="qwen_proj",
        apply_text_rotary_emb=False,
    )
    released.update(hidden_size=64, num_heads=2, axes_dim=[8, 12, 12], depth=1, context_in_dim=8)
    model = MageFlowTransformer2DModel.from_config(released)
    assert model.config.depth == 1 and len(model.transformer_blocks) == 1
    assert model.checkpoint is False and model.config["checkpoint"] is False  # the released switch


def test_bad_packing_is_rejected(model):
    a = _sample(model, 0, (4, 6), 5)
    with pytest.raises(ValueError, match="cu_seqlens"):
        model(
            hidden_states=a["img"][None],
            encoder_hidden_states=a["txt"][None],
            timestep=a["sigma"],
            img_shapes=[a["shape"]],
            img_cu_seqlens=lengths_to_cu_seqlens([20]),
            txt_cu_seqlens=lengths_to_cu_seqlens([5]),
        )
    with pytest.raises(ValueError, match="img_shapes"):
        model(
            hidden_states=a["img"][None],
            encoder_hidden_states=a["txt"][None],
            timestep=a["sigma"],
            img_shapes=[(1, 4, 5)],
            img_cu_seqlens=lengths_to_cu_seqlens([24]),
            txt_cu_seqlens=lengths_to_cu_seqlens([5]),
        )
