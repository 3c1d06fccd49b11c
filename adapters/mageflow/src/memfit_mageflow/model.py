"""A reference implementation of the Mage-Flow transformer (NR-MMDiT), written from its published description.

Mage-Flow (Microsoft, github.com/microsoft/Mage, arXiv 2607.19064) is a 4B rectified-flow
*Native-Resolution Multimodal Diffusion Transformer*. It is not part of diffusers, so memfit ships
this implementation, whose module tree and state-dict keys follow the upstream
``mage_flow/models/mage_flow.py`` (class ``MageFlow``) and ``modules/mage_layers.py``
(``MageFlowTransformerBlock``), as two classes that are called the way the real ones are:

* :class:`MageFlow` — upstream's base class: a plain module with its own ``checkpoint`` switch, which wraps
  each block in ``torch.utils.checkpoint`` itself;
* :class:`MageFlowTransformer2DModel` — the diffusers wrapper trainers train (SimpleTuner's class of that
  name): ``enable_gradient_checkpointing`` turns the same switch on (attribute and ``config.checkpoint``), and
  forward calls the checkpointing function with a closure over each block and ``use_reentrant=False``.

The architecture, as implemented here:

* Inputs are *packed*: every sample of a batch is concatenated along one token axis
  (``[1, total_tokens, channels]``) and ``cu_seqlens`` (``[0, l0, l0+l1, ...]``, int32) marks where
  each sample starts — separately for the image stream and the text stream. Samples may have
  different resolutions and prompt lengths; no padding.
* ``img_in`` (Linear) embeds the Mage-VAE latent tokens (128 channels, 16x downsampling, no 2x2
  patch packing); the text (Qwen3-VL hidden states, 2560 wide) goes through ``txt_norm`` (RMSNorm)
  then ``txt_in`` (Linear).
* ``time_text_embed``: a 256-channel sinusoidal embedding of ``sigma * 1000`` (cos first) and a
  two-layer SiLU MLP; one embedding per packed sample. No guidance embedding, no pooled text.
* ``transformer_blocks``: ``depth`` double-stream blocks and *no* single-stream blocks. Each block has
  its own per-stream adaLN modulation (``img_mod`` / ``txt_mod``: SiLU -> Linear(dim, 6*dim) giving
  shift/scale/gate for the attention and the MLP half), affine-free LayerNorms, one joint attention
  (``attn``: image ``to_q/to_k/to_v``, text ``add_q_proj/add_k_proj/add_v_proj``, per-head RMSNorm on
  queries and keys, outputs ``to_out[0]`` / ``to_add_out``), and per-stream GELU(tanh) MLPs
  (``img_mlp`` / ``txt_mlp``, 4x wide). Per sample the joint sequence is ``[text, image]``; attention
  never crosses samples.
* 3-axis (frame, height, width) rotary embedding on the image queries/keys only (text is not
  rotated); height/width positions are centred on the image (``scale_rope``), the frame coordinate
  of an image segment is its index in the pack.
* ``norm_out`` (adaLN-continuous, per sample) and ``proj_out`` on the image stream.

Varlen attention runs in pure PyTorch (one ``scaled_dot_product_attention`` per packed sample), so the
model runs on CPU; upstream uses FlashAttention's ``flash_attn_varlen_func`` over the same layout.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.attention import FeedForward
from diffusers.models.embeddings import TimestepEmbedding
from diffusers.models.modeling_utils import ModelMixin
from diffusers.models.normalization import RMSNorm
from torch import nn

__all__ = [
    "MageFlow",
    "MageFlowAttention",
    "MageFlowParams",
    "MageFlowTransformer2DModel",
    "MageFlowTransformerBlock",
    "apply_rotary_emb",
    "host_bounds",
    "lengths_to_cu_seqlens",
    "varlen_joint_attention",
]

Shape3 = tuple[int, int, int]


# -- packing helpers -----------------------------------------------------------------------------------------------


def lengths_to_cu_seqlens(lengths: Sequence[int], device: torch.device | str | None = None) -> torch.Tensor:
    """``[l0, l1, ...]`` -> ``[0, l0, l0+l1, ...]`` as int32 (the flash-attn varlen convention)."""
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=device)
    if lengths:
        out[1:] = torch.cumsum(torch.tensor(list(lengths), dtype=torch.int32, device=device), dim=0)
    return out


def host_bounds(cu_seqlens: torch.Tensor) -> list[int]:
    """``cu_seqlens`` as Python ints, read from the device once per tensor (and again only after an in-place edit).

    The model reads the boundaries once as it packs its inputs and keeps them on the tensor it hands every
    block: ``tolist()`` waits for the GPU, and one wait per attention call (forward and recompute) would leave the
    GPU idle while the host catches up, which upstream's ``flash_attn_varlen_func`` (given the maximum length
    once) never does.
    """
    cached = getattr(cu_seqlens, "_host_bounds", None)
    if cached is not None and cached[0] == cu_seqlens._version:
        return list(cached[1])
    bounds = cu_seqlens.tolist()
    _keep_host_bounds(cu_seqlens, bounds)
    return bounds


def _keep_host_bounds(cu_seqlens: torch.Tensor, bounds: Sequence[int]) -> None:
    """Remember ``bounds`` on ``cu_seqlens`` for :func:`host_bounds`, valid until its next in-place edit."""
    cu_seqlens._host_bounds = (cu_seqlens._version, tuple(bounds))


def _per_token(values: torch.Tensor, cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Expand per-sample rows ``[n, D]`` to per-token rows ``[total, D]`` following ``cu_seqlens``."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    return values.repeat_interleave(lengths, dim=0, output_size=total)


def _modulate(
    x: torch.Tensor, params: torch.Tensor, cu_seqlens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """adaLN on a packed stream: ``x * (1 + scale) + shift`` with each sample's own shift/scale.

    ``params`` is ``[n_samples, 3 * dim]`` (shift, scale, gate); returns the modulated ``x`` and the
    per-token gate, both shaped like ``x``.
    """
    shift, scale, gate = params.chunk(3, dim=-1)
    flat = x.reshape(-1, x.shape[-1])
    total = flat.shape[0]
    shift_t = _per_token(shift, cu_seqlens, total)
    scale_t = _per_token(scale, cu_seqlens, total)
    gate_t = _per_token(gate, cu_seqlens, total)
    out = flat * (1 + scale_t) + shift_t
    return out.reshape(x.shape), gate_t.reshape(x.shape)


# -- rotary embedding ------------------------------------------------------------------------------------------------


def apply_rotary_emb(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent channel pairs of ``x`` ``[tokens, heads, head_dim]`` by complex ``freqs`` ``[tokens, head_dim/2]``."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    rotated = torch.view_as_real(pairs * freqs.unsqueeze(-2)).flatten(-2)
    return rotated.type_as(x)


class MageFlowEmbedRope(nn.Module):
    """3-axis (frame, height, width) rotary frequencies for the packed image tokens (text is not rotated).

    ``img_shapes`` lists one ``(frames, height, width)`` per image segment, in pack order (a sample may
    own several segments, e.g. an edit target and its references). As upstream, the frame coordinate of
    segment ``k`` starts at ``k``; with ``scale_rope`` the height/width coordinates are centred on the
    image (``-(n - n//2) .. n//2 - 1``), without it they run ``0 .. n-1``.

    The tables are complex and computed on demand (not buffers: a dtype cast of the model must not
    touch them, and a ``meta``-device init must not need them).
    """

    def __init__(self, theta: float, axes_dim: Sequence[int], scale_rope: bool = True) -> None:
        super().__init__()
        self.theta = float(theta)
        self.axes_dim = tuple(int(d) for d in axes_dim)
        self.scale_rope = scale_rope
        self._cache: dict[tuple, torch.Tensor] = {}

    def _axis(self, positions: torch.Tensor, dim: int) -> torch.Tensor:
        inv_freq = 1.0 / torch.pow(
            self.theta, torch.arange(0, dim, 2, device=positions.device).float().div(dim)
        )
        angles = torch.outer(positions.float(), inv_freq)
        return torch.polar(torch.ones_like(angles), angles)

    def _centred(self, n: int, device: torch.device) -> torch.Tensor:
        start = -(n - n // 2) if self.scale_rope else 0
        return torch.arange(start, start + n, device=device)

    def segment(self, shape: Shape3, index: int, device: torch.device) -> torch.Tensor:
        """Frequencies ``[f*h*w, head_dim/2]`` of one image segment at pack position ``index``."""
        frames, height, width = (int(v) for v in shape)
        key = (str(device), frames, height, width, index)
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        df, dh, dw = self.axes_dim
        f = self._axis(torch.arange(index, index + frames, device=device), df)
        h = self._axis(self._centred(height, device), dh)
        w = self._axis(self._centred(width, device), dw)
        grid = torch.cat(
            [
                f.view(frames, 1, 1, -1).expand(frames, height, width, -1),
                h.view(1, height, 1, -1).expand(frames, height, width, -1),
                w.view(1, 1, width, -1).expand(frames, height, width, -1),
            ],
            dim=-1,
        ).reshape(frames * height * width, -1)
        if len(self._cache) >= 256:  # aspect-ratio buckets change; keep the cache bounded
            self._cache.clear()
        self._cache[key] = grid
        return grid

    def forward(self, img_shapes: Sequence[Shape3], device: torch.device) -> torch.Tensor:
        return torch.cat([self.segment(shape, k, device) for k, shape in enumerate(img_shapes)], dim=0)


# -- timestep embedding ----------------------------------------------------------------------------------------------


def _timestep_sinusoids(
    timesteps: torch.Tensor, channels: int = 256, scale: float = 1000.0, max_period: float = 10000.0
) -> torch.Tensor:
    """``[cos | sin]`` of ``scale * t * exp(-ln(max_period) * i / half)``.

    The frequency table is rounded to ``timesteps.dtype`` before use, as upstream does: the released
    weights were trained on that bf16 rounding (a float32 table gives a slightly different embedding).
    """
    half = channels // 2
    exponent = -math.log(max_period) * torch.arange(half, dtype=torch.float32, device=timesteps.device) / half
    freqs = torch.exp(exponent).to(timesteps.dtype)
    args = scale * (timesteps[:, None].float() * freqs[None, :])
    emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    if channels % 2:
        emb = F.pad(emb, (0, 1))
    return emb


class MageFlowTimestepProjEmbeddings(nn.Module):
    """Sinusoidal (256 channels, sigma scaled by 1000) -> ``timestep_embedder`` MLP; one row per sample."""

    def __init__(self, embedding_dim: int, channels: int = 256) -> None:
        super().__init__()
        self.channels = channels
        self.timestep_embedder = TimestepEmbedding(in_channels=channels, time_embed_dim=embedding_dim)

    def forward(self, timestep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.timestep_embedder(_timestep_sinusoids(timestep, self.channels).to(dtype))


# -- attention -------------------------------------------------------------------------------------------------------


def varlen_joint_attention(
    txt_q: torch.Tensor,
    txt_k: torch.Tensor,
    txt_v: torch.Tensor,
    img_q: torch.Tensor,
    img_k: torch.Tensor,
    img_v: torch.Tensor,
    txt_cu_seqlens: torch.Tensor,
    img_cu_seqlens: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Joint ``[text, image]`` attention per packed sample, never across samples.

    All inputs are ``[tokens, heads, head_dim]`` of their stream. Sample ``i`` attends over its text
    tokens ``txt_cu[i]:txt_cu[i+1]`` followed by its image tokens ``img_cu[i]:img_cu[i+1]`` —
    the sequence ``flash_attn_varlen_func`` sees upstream (non-causal, scale ``1/sqrt(head_dim)``).
    Returns the text part and the image part of the output, in the input layout.
    """
    txt_b = host_bounds(txt_cu_seqlens)
    img_b = host_bounds(img_cu_seqlens)
    if len(txt_b) != len(img_b):
        raise ValueError(
            f"packed text and image streams disagree on the number of samples: {len(txt_b) - 1} text "
            f"segments, {len(img_b) - 1} image segments"
        )
    txt_out, img_out = [], []
    for t0, t1, i0, i1 in zip(txt_b[:-1], txt_b[1:], img_b[:-1], img_b[1:], strict=True):
        q = torch.cat([txt_q[t0:t1], img_q[i0:i1]]).transpose(0, 1)
        k = torch.cat([txt_k[t0:t1], img_k[i0:i1]]).transpose(0, 1)
        v = torch.cat([txt_v[t0:t1], img_v[i0:i1]]).transpose(0, 1)
        o = F.scaled_dot_product_attention(q, k, v).transpose(0, 1)
        txt_out.append(o[: t1 - t0])
        img_out.append(o[t1 - t0 :])
    return torch.cat(txt_out), torch.cat(img_out)


class MageFlowAttention(nn.Module):
    """Double-stream joint attention: image projections ``to_*``, text projections ``add_*_proj``,
    per-head RMSNorm on queries/keys, rotary on image tokens, one varlen attention over both streams."""

    def __init__(self, dim: int, heads: int, head_dim: int, eps: float = 1e-6, bias: bool = True) -> None:
        super().__init__()
        inner = heads * head_dim
        self.heads = heads
        self.head_dim = head_dim
        self.to_q = nn.Linear(dim, inner, bias=bias)
        self.to_k = nn.Linear(dim, inner, bias=bias)
        self.to_v = nn.Linear(dim, inner, bias=bias)
        self.norm_q = RMSNorm(head_dim, eps=eps)
        self.norm_k = RMSNorm(head_dim, eps=eps)
        self.add_q_proj = nn.Linear(dim, inner, bias=bias)
        self.add_k_proj = nn.Linear(dim, inner, bias=bias)
        self.add_v_proj = nn.Linear(dim, inner, bias=bias)
        self.norm_added_q = RMSNorm(head_dim, eps=eps)
        self.norm_added_k = RMSNorm(head_dim, eps=eps)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim, bias=True), nn.Dropout(0.0)])
        self.to_add_out = nn.Linear(inner, dim, bias=True)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(-1, self.heads, self.head_dim)

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        image_rotary_emb: torch.Tensor,
        txt_cu_lens: torch.Tensor,
        img_cu_lens: torch.Tensor,
        **_unused: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        img_q = apply_rotary_emb(self.norm_q(self._heads(self.to_q(hidden_states))), image_rotary_emb)
        img_k = apply_rotary_emb(self.norm_k(self._heads(self.to_k(hidden_states))), image_rotary_emb)
        img_v = self._heads(self.to_v(hidden_states))
        txt_q = self.norm_added_q(self._heads(self.add_q_proj(encoder_hidden_states)))
        txt_k = self.norm_added_k(self._heads(self.add_k_proj(encoder_hidden_states)))
        txt_v = self._heads(self.add_v_proj(encoder_hidden_states))
        txt_o, img_o = varlen_joint_attention(
            txt_q, txt_k, txt_v, img_q, img_k, img_v, txt_cu_lens, img_cu_lens
        )
        img_o = self.to_out[1](self.to_out[0](img_o.flatten(1).to(hidden_states.dtype)))
        txt_o = self.to_add_out(txt_o.flatten(1).to(encoder_hidden_states.dtype))
        return img_o.reshape(hidden_states.shape), txt_o.reshape(encoder_hidden_states.shape)


# -- the double-stream block -------------------------------------------------------------------------------------------


class MageFlowTransformerBlock(nn.Module):
    """One double-stream block. Call order: ``img_mod``, ``txt_mod``, norms, ``attn``, gated residuals,
    ``img_mlp`` (gated residual), ``txt_mlp`` (gated residual). Returns ``(text, image)`` like upstream."""

    def __init__(
        self,
        dim: int,
        num_attention_heads: int,
        attention_head_dim: int,
        mlp_ratio: float = 4.0,
        eps: float = 1e-6,
    ) -> None:
        super().__init__()
        self.dim = dim
        self.img_mod = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim, bias=True))
        self.img_norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=eps)
        self.attn = MageFlowAttention(dim, num_attention_heads, attention_head_dim, eps=eps)
        self.img_norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=eps)
        self.img_mlp = FeedForward(
            dim=dim, dim_out=dim, inner_dim=int(dim * mlp_ratio), activation_fn="gelu-approximate"
        )
        self.txt_mod = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim, bias=True))
        self.txt_norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=eps)
        self.txt_norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=eps)
        self.txt_mlp = FeedForward(
            dim=dim, dim_out=dim, inner_dim=int(dim * mlp_ratio), activation_fn="gelu-approximate"
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        temb: torch.Tensor,
        image_rotary_emb: torch.Tensor,
        txt_cu_lens: torch.Tensor,
        img_cu_lens: torch.Tensor,
        joint_attention_kwargs: dict[str, Any] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        img_mod1, img_mod2 = self.img_mod(temb).chunk(2, dim=-1)
        txt_mod1, txt_mod2 = self.txt_mod(temb).chunk(2, dim=-1)

        img_x, img_gate1 = _modulate(self.img_norm1(hidden_states), img_mod1, img_cu_lens)
        txt_x, txt_gate1 = _modulate(self.txt_norm1(encoder_hidden_states), txt_mod1, txt_cu_lens)
        img_attn, txt_attn = self.attn(
            hidden_states=img_x,
            encoder_hidden_states=txt_x,
            image_rotary_emb=image_rotary_emb,
            txt_cu_lens=txt_cu_lens,
            img_cu_lens=img_cu_lens,
            **(joint_attention_kwargs or {}),
        )
        hidden_states = hidden_states + img_gate1 * img_attn
        encoder_hidden_states = encoder_hidden_states + txt_gate1 * txt_attn

        img_x2, img_gate2 = _modulate(self.img_norm2(hidden_states), img_mod2, img_cu_lens)
        hidden_states = hidden_states + img_gate2 * self.img_mlp(img_x2)
        txt_x2, txt_gate2 = _modulate(self.txt_norm2(encoder_hidden_states), txt_mod2, txt_cu_lens)
        encoder_hidden_states = encoder_hidden_states + txt_gate2 * self.txt_mlp(txt_x2)

        if encoder_hidden_states.dtype == torch.float16:
            encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)
        if hidden_states.dtype == torch.float16:
            hidden_states = hidden_states.clip(-65504, 65504)
        return encoder_hidden_states, hidden_states


class MageFlowAdaLayerNormContinuous(nn.Module):
    """Output adaLN: affine-free LayerNorm, then each sample's ``(1 + scale)`` / ``shift`` from ``temb``."""

    def __init__(self, dim: int, conditioning_dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.silu = nn.SiLU()
        self.linear = nn.Linear(conditioning_dim, 2 * dim, bias=True)
        self.norm = nn.LayerNorm(dim, eps=eps, elementwise_affine=False)

    def forward(self, x: torch.Tensor, temb: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        scale, shift = self.linear(self.silu(temb).to(x.dtype)).chunk(2, dim=-1)
        flat = x.reshape(-1, x.shape[-1])
        total = flat.shape[0]
        out = self.norm(flat) * (1 + _per_token(scale, cu_seqlens, total)) + _per_token(
            shift, cu_seqlens, total
        )
        return out.reshape(x.shape)


# -- the model ---------------------------------------------------------------------------------------------------------


def _normalise_shapes(img_shapes: Any) -> list[Shape3]:
    """Accept a flat list of ``(f, h, w)`` or the upstream form ``[[(f, h, w), ...]]`` (batch-of-one wrapper)."""
    shapes = list(img_shapes)
    if len(shapes) == 1 and isinstance(shapes[0], list):
        shapes = list(shapes[0])
    out = []
    for shape in shapes:
        if len(shape) != 3:
            raise ValueError(f"img_shapes entries are (frames, height, width), got {shape!r}")
        out.append((int(shape[0]), int(shape[1]), int(shape[2])))
    return out


def _pack(x: torch.Tensor, cu_seqlens: torch.Tensor | None, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A packed ``[1, total, C]`` stream and its cu_seqlens; an unpacked ``[B, L, C]`` batch becomes B samples of L."""
    if x.ndim != 3:
        raise ValueError(
            f"{what} must be [batch, tokens, channels] (packed: batch 1), got shape {tuple(x.shape)}"
        )
    if cu_seqlens is None:
        batch, length = x.shape[:2]
        cu_seqlens = torch.arange(0, (batch + 1) * length, length, dtype=torch.int32, device=x.device)
        _keep_host_bounds(cu_seqlens, range(0, (batch + 1) * length, length))
        return x.reshape(1, batch * length, x.shape[-1]), cu_seqlens
    if x.shape[0] != 1:
        raise ValueError(
            f"{what} with cu_seqlens must be packed as [1, total_tokens, channels], got {tuple(x.shape)}"
        )
    bounds = cu_seqlens.tolist()  # once per forward: the blocks read them from the tensor (host_bounds)
    if (
        bounds[0] != 0
        or bounds[-1] != x.shape[1]
        or any(b <= a for a, b in zip(bounds, bounds[1:], strict=False))
    ):
        raise ValueError(
            f"{what}: cu_seqlens {bounds} must start at 0, increase strictly and end at the token count {x.shape[1]}"
        )
    packed = cu_seqlens.to(device=x.device, dtype=torch.int32)
    if packed is cu_seqlens:  # the caller's tensor: keep it as given (a tensor of its own takes the bounds)
        packed = cu_seqlens.view(cu_seqlens.shape)
    _keep_host_bounds(packed, bounds)
    return x, packed


@dataclass
class MageFlowParams:
    """Upstream's parameter struct (``mage_flow/models/mage_flow.py``); ``mlp_ratio`` and ``theta`` are fixed
    there (4.0, 10000) and parameters here."""

    in_channels: int = 128
    out_channels: int = 128
    context_in_dim: int = 2560
    hidden_size: int = 3072
    num_heads: int = 24
    depth: int = 12
    axes_dim: Sequence[int] = (16, 56, 56)
    checkpoint: bool = False
    patch_size: int = 1
    mlp_ratio: float = 4.0
    theta: int = 10000


class MageFlow(nn.Module):
    """Mage-Flow's NR-MMDiT as upstream's base class ``MageFlow`` is called: a plain ``nn.Module`` built from a
    :class:`MageFlowParams`, with its own checkpointing switch ``checkpoint``.

    Checkpointing convention (upstream's): in training mode with ``checkpoint`` on, every block goes through
    ``torch.utils.checkpoint.checkpoint(block, img, txt, temb, rotary, txt_cu, img_cu, use_reentrant=False)``
    itself; there is no diffusers ``gradient_checkpointing_func`` hook (memfit enters the blocks through forward
    hooks, and switches ``checkpoint`` off while applied: the adapter declares it).

    Forward (packed, variable length; the positional order is upstream's ``img, txt, timesteps, img_shapes,
    img_cu_seqlens, txt_cu_seqlens, attention_kwargs``, the keyword names diffusers'):
        hidden_states: ``[1, total_image_tokens, in_channels]`` — every sample's latent tokens, concatenated.
        encoder_hidden_states: ``[1, total_text_tokens, context_in_dim]``.
        timestep: ``[n_samples]`` flow sigma in [0, 1] (1 = noise), one per sample.
        img_shapes: ``(frames, height, width)`` of every image segment in pack order (sums to the image tokens).
        img_cu_seqlens / txt_cu_seqlens: ``[n_samples + 1]`` int32 sample boundaries of each stream.
        attention_kwargs: passed to every block's attention (not through the checkpointed call, as upstream).

    Returns the image stream's output tokens, shaped like ``hidden_states`` with ``out_channels``. Without
    cu_seqlens, ``[B, L, C]`` inputs are taken as B samples of equal length (an ordinary batch).
    """

    def __init__(self, params: MageFlowParams) -> None:
        super().__init__()
        hidden_size, num_heads, axes_dim = params.hidden_size, params.num_heads, tuple(params.axes_dim)
        if hidden_size % num_heads:
            raise ValueError(f"hidden_size {hidden_size} is not a multiple of num_heads {num_heads}")
        head_dim = hidden_size // num_heads
        if len(axes_dim) != 3 or sum(axes_dim) != head_dim or any(d % 2 for d in axes_dim):
            raise ValueError(f"axes_dim {axes_dim} must be 3 even sizes summing to the head dim {head_dim}")
        self.params = params
        self.checkpoint = params.checkpoint
        self.inner_dim = hidden_size
        self.out_channels = params.out_channels

        self.pos_embed = MageFlowEmbedRope(theta=params.theta, axes_dim=axes_dim, scale_rope=True)
        self.img_in = nn.Linear(params.in_channels, hidden_size)
        self.txt_norm = RMSNorm(params.context_in_dim, eps=1e-6)
        self.txt_in = nn.Linear(params.context_in_dim, hidden_size)
        self.time_text_embed = MageFlowTimestepProjEmbeddings(hidden_size)
        self.transformer_blocks = nn.ModuleList(
            [
                MageFlowTransformerBlock(hidden_size, num_heads, head_dim, mlp_ratio=params.mlp_ratio)
                for _ in range(params.depth)
            ]
        )
        self.norm_out = MageFlowAdaLayerNormContinuous(hidden_size, hidden_size, eps=1e-6)
        self.proj_out = nn.Linear(hidden_size, params.patch_size * params.patch_size * params.out_channels)

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        img_shapes: Sequence[Shape3] | Sequence[Sequence[Shape3]],
        img_cu_seqlens: torch.Tensor | None = None,
        txt_cu_seqlens: torch.Tensor | None = None,
        attention_kwargs: dict[str, Any] | None = None,
    ) -> torch.Tensor:
        unpacked_shape = None if img_cu_seqlens is not None else hidden_states.shape[:2]
        img, img_cu = _pack(hidden_states, img_cu_seqlens, "hidden_states")
        txt, txt_cu = _pack(encoder_hidden_states, txt_cu_seqlens, "encoder_hidden_states")
        samples = img_cu.numel() - 1
        if txt_cu.numel() - 1 != samples:
            raise ValueError(f"{samples} image samples but {txt_cu.numel() - 1} text samples in the pack")
        shapes = _normalise_shapes(img_shapes)
        if sum(f * h * w for f, h, w in shapes) != img.shape[1]:
            raise ValueError(
                f"img_shapes {shapes} cover {sum(f * h * w for f, h, w in shapes)} tokens, "
                f"hidden_states has {img.shape[1]}"
            )
        timestep = torch.as_tensor(timestep, device=img.device).reshape(-1)
        if timestep.numel() == 1 and samples > 1:
            timestep = timestep.expand(samples)
        if timestep.numel() != samples:
            raise ValueError(f"timestep has {timestep.numel()} values for {samples} packed samples")

        rotary = self.pos_embed(shapes, img.device)
        img = self.img_in(img)
        txt = self.txt_in(self.txt_norm(txt))
        temb = self.time_text_embed(timestep.to(img.dtype), img.dtype)
        attention_kwargs = attention_kwargs or {}

        for block in self.transformer_blocks:
            if self.training and self.checkpoint:
                txt, img = self._checkpointed_block(
                    block, (img, txt, temb, rotary, txt_cu, img_cu), attention_kwargs
                )
            else:
                txt, img = block(
                    hidden_states=img,
                    encoder_hidden_states=txt,
                    temb=temb,
                    image_rotary_emb=rotary,
                    txt_cu_lens=txt_cu,
                    img_cu_lens=img_cu,
                    joint_attention_kwargs=attention_kwargs,
                )

        out = self.proj_out(self.norm_out(img, temb, img_cu))
        if unpacked_shape is not None:
            out = out.reshape(*unpacked_shape, out.shape[-1])
        return out

    def _checkpointed_block(
        self, block: nn.Module, inputs: tuple[torch.Tensor, ...], attention_kwargs: dict[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Upstream's checkpointing branch: the block itself, positional inputs ``(img, txt, temb, rotary, txt_cu,
        img_cu)``, ``use_reentrant=False``."""
        return torch.utils.checkpoint.checkpoint(block, *inputs, use_reentrant=False)


class MageFlowTransformer2DModel(MageFlow, ModelMixin, ConfigMixin):
    """Mage-Flow as trainers train it: a diffusers ``ModelMixin`` + ``ConfigMixin`` subclass of
    :class:`MageFlow`, configured by the released ``transformer/config.json`` keys (unknown upstream keys are
    ignored by ``from_config``), the wrapper class SimpleTuner trains.

    Checkpointing convention (the trainer wrapper's): ``_supports_gradient_checkpointing``;
    ``enable_gradient_checkpointing(gradient_checkpointing_func=...)`` turns the model's own switch on — the
    ``checkpoint`` attribute and ``config.checkpoint`` — and keeps the function; in training mode with the switch
    on, forward calls that function with a *closure* over each block (not the block) and the
    ``torch.utils.checkpoint`` keyword ``use_reentrant=False``. The default function is
    ``torch.utils.checkpoint.checkpoint``.

    Forward: as :class:`MageFlow`; returns the output tensor, or ``(output,)`` with ``return_dict=False``.
    """

    _supports_gradient_checkpointing = True
    _no_split_modules = ["MageFlowTransformerBlock"]
    _repeated_blocks = ["MageFlowTransformerBlock"]
    _skip_layerwise_casting_patterns = ["pos_embed", "norm"]

    @register_to_config
    def __init__(
        self,
        in_channels: int = 128,
        out_channels: int = 128,
        context_in_dim: int = 2560,
        hidden_size: int = 3072,
        num_heads: int = 24,
        depth: int = 12,
        axes_dim: tuple[int, ...] = (16, 56, 56),
        patch_size: int = 1,
        mlp_ratio: float = 4.0,
        theta: int = 10000,
        checkpoint: bool = False,
    ) -> None:
        params = MageFlowParams(
            in_channels=in_channels,
            out_channels=out_channels,
            context_in_dim=context_in_dim,
            hidden_size=hidden_size,
            num_heads=num_heads,
            depth=depth,
            axes_dim=axes_dim,
            checkpoint=checkpoint,
            patch_size=patch_size,
            mlp_ratio=mlp_ratio,
            theta=theta,
        )
        MageFlow.__init__(self, params)
        self._gradient_checkpointing_func = torch.utils.checkpoint.checkpoint

    def enable_gradient_checkpointing(
        self, gradient_checkpointing_func: Callable[..., Any] | None = None
    ) -> None:
        self.checkpoint = True
        self.config.checkpoint = True  # an attribute of diffusers' FrozenDict, as the trainer's class sets it
        if gradient_checkpointing_func is not None:
            self._gradient_checkpointing_func = gradient_checkpointing_func

    def disable_gradient_checkpointing(self) -> None:
        self.checkpoint = False
        self.config.checkpoint = False

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        img_shapes: Sequence[Shape3] | Sequence[Sequence[Shape3]],
        img_cu_seqlens: torch.Tensor | None = None,
        txt_cu_seqlens: torch.Tensor | None = None,
        attention_kwargs: dict[str, Any] | None = None,
        return_dict: bool | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor]:
        out = super().forward(
            hidden_states,
            encoder_hidden_states,
            timestep,
            img_shapes,
            img_cu_seqlens,
            txt_cu_seqlens,
            attention_kwargs,
        )
        return (out,) if return_dict is False else out

    def _checkpointed_block(
        self, block: nn.Module, inputs: tuple[torch.Tensor, ...], attention_kwargs: dict[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The trainer wrapper's checkpointing branch: its function, a closure over the block (which calls it by
        keyword, attention kwargs included), ``use_reentrant=False``."""

        def run_checkpointed_block(img, txt, temb, rotary, txt_cu, img_cu, checkpoint_block=block):
            return checkpoint_block(
                hidden_states=img,
                encoder_hidden_states=txt,
                temb=temb,
                image_rotary_emb=rotary,
                txt_cu_lens=txt_cu,
                img_cu_lens=img_cu,
                joint_attention_kwargs=attention_kwargs,
            )

        return self._gradient_checkpointing_func(run_checkpointed_block, *inputs, use_reentrant=False)
