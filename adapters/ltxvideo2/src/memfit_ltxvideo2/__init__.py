"""memfit adapter for LTX-2 (joint video + audio): declarations only — the core executes."""

from __future__ import annotations

from typing import Any

import torch

from memfit import BlockSpec, FamilyAdapter, Preset
from memfit_ltxvideo2.presets import PIXELS, build_full, build_tiny, make_inputs


def audio_video_loss(output: Any) -> torch.Tensor:
    """A scalar that depends on *both* outputs.

    ``LTX2VideoTransformer3DModel`` returns ``AudioVisualModelOutput(sample, audio_sample)`` or the
    tuple ``(video, audio)``. memfit's default loss takes ``.sample`` / the first element only, which
    would leave the audio head and the audio half of the last block(s) out of backward, so neither
    their recompute nor their gradients would be checked.
    """
    if hasattr(output, "audio_sample"):
        video, audio = output.sample, output.audio_sample
    elif isinstance(output, (tuple, list)) and len(output) >= 2:
        video, audio = output[0], output[1]
    else:
        raise TypeError(
            f"expected an AudioVisualModelOutput or a (video, audio) tuple from LTX-2, got {type(output).__name__}"
        )
    return video.float().pow(2).mean() + audio.float().pow(2).mean()


ADAPTER = FamilyAdapter(
    name="ltxvideo2",
    model_classes=("LTX2VideoTransformer3DModel",),
    block_lists=("transformer_blocks",),
    blocks={
        # One dual-stream block updates the video and the audio residual streams:
        #   attn1 / audio_attn1                       self-attention (video, audio)
        #   attn2 / audio_attn2                       cross-attention to the text (video, audio)
        #   audio_to_video_attn / video_to_audio_attn cross-modal attention (Q video/K,V audio and back)
        #   ff / audio_ff                             feed-forward (video, audio)
        # Each FFN reads one modulated-norm tensor, `ff(norm3(x) * (1 + scale) + shift)`, and its
        # output is only gated and added to the residual afterwards (`x + ff_out * gate`): nothing
        # between the FFN call and the next statement needs the FFN's activations, so each FFN is its
        # own one-module region. Every attention is likewise a single sub-module call whose output
        # is only gated and added to its stream. The a2v/v2a attentions are skipped when the model
        # runs with `isolate_modalities=True`; a declared attention region that is not called simply
        # records nothing.
        "LTX2VideoTransformerBlock": BlockSpec(
            ffn=(("ff",), ("audio_ff",)),
            attention=(
                ("attn1",),
                ("audio_attn1",),
                ("attn2",),
                ("audio_attn2",),
                ("audio_to_video_attn",),
                ("video_to_audio_attn",),
            ),
        ),
    },
    # The model calls each block as `video, audio = block(video, audio, <shared tensors>)`: the only
    # per-block state is the (video, audio) pair, the other arguments (text, timestep embeddings,
    # RoPE tables, masks) are the same objects for every block, so consecutive blocks chain cleanly.
    supports_interval=True,
    verified_versions={"diffusers": ("0.42.1",)},
    block_count_config={"transformer_blocks": "num_layers"},
    presets={
        "tiny": Preset(
            build=build_tiny,
            inputs=make_inputs,
            pixels=PIXELS,
            default_tokens=32,
            description="3 blocks, video width 16 / audio width 8 (tests, CPU)",
        ),
        "full": Preset(
            build=build_full,
            inputs=make_inputs,
            pixels=PIXELS,
            default_tokens=6144,
            description="LTX-2 size: 48 blocks, video width 4096 / audio width 2048 (random weights); "
            "6144 tokens = 121 frames at 512x768",
        ),
    },
    loss=audio_video_loss,
    notes=(
        "Blocks return a (video, audio) pair; both streams are chained across interval chunks. "
        "FFN scope checkpoints `ff` and `audio_ff`. The loss sums both outputs. Video tokens map to "
        "latent frames x height x width (see memfit_ltxvideo2.presets)."
    ),
)

__all__ = ["ADAPTER", "audio_video_loss"]
