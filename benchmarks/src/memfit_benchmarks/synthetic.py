"""A synthetic DiT stack with the shapes of SPEC §6, for sweeps that do not depend on one family.

Each block is a pre-norm transformer block: attention (fused qkv projection, SDPA, output
projection) and a 4× GELU(tanh) FFN, with adaLN-style modulation from a shared embedding
(so every block also receives a tensor shared by all blocks, like a DiT's time embedding).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from memfit import BlockSpec, FamilyAdapter, Preset
from memfit_benchmarks.training import TrainingConfig, prepare


class SynthAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.to_qkv = nn.Linear(dim, 3 * dim)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.to_qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.to_out(out.transpose(1, 2).reshape(b, n, d))


class SynthFeedForward(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj_in = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU(approximate="tanh")
        self.proj_out = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj_out(self.act(self.proj_in(x)))


class SynthBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False)
        self.attn = SynthAttention(dim, heads)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False)
        self.ff = SynthFeedForward(dim)
        self.modulation = nn.Linear(dim, 4 * dim)

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        shift1, scale1, shift2, scale2 = self.modulation(emb).unsqueeze(1).chunk(4, dim=-1)
        x = x + self.attn(self.norm1(x) * (1 + scale1) + shift1)
        return x + self.ff(self.norm2(x) * (1 + scale2) + shift2)


class SynthStack(nn.Module):
    def __init__(
        self, dim: int = 3072, depth: int = 15, heads: int | None = None, in_channels: int = 64
    ) -> None:
        super().__init__()
        heads = heads or max(1, dim // 128 if dim >= 128 else dim // 16)
        self.proj_in = nn.Linear(in_channels, dim)
        self.emb = nn.Linear(256, dim)
        self.blocks = nn.ModuleList(SynthBlock(dim, heads) for _ in range(depth))
        self.proj_out = nn.Linear(dim, in_channels)

    def forward(self, hidden_states: torch.Tensor, timestep_emb: torch.Tensor) -> torch.Tensor:
        emb = F.silu(self.emb(timestep_emb))
        x = self.proj_in(hidden_states)
        for block in self.blocks:
            x = block(x, emb)
        return self.proj_out(x)


def build(
    *,
    dim: int = 3072,
    depth: int = 15,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cuda",
    seed: int = 0,
) -> SynthStack:
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return SynthStack(dim=dim, depth=depth)
    finally:
        torch.set_default_dtype(previous)


def inputs(model: SynthStack, *, tokens: int = 4096, batch: int = 1, generator=None) -> dict:
    p = next(model.parameters())
    return {
        "hidden_states": torch.randn(batch, tokens, model.proj_in.in_features, generator=generator).to(p),
        "timestep_emb": torch.randn(batch, 256, generator=generator).to(p),
    }


SYNTHETIC = FamilyAdapter(
    name="synthetic",
    model_classes=("SynthStack",),
    block_lists=("blocks",),
    blocks={"SynthBlock": BlockSpec(ffn=(("ff",),), attention=(("attn",),))},
    supports_interval=True,
    presets={
        "tiny": Preset(build=lambda **kw: build(dim=64, depth=4, **kw), inputs=inputs, default_tokens=64)
    },
    loss=lambda out: out.float().pow(2).mean(),
    notes="benchmark stack (not an installed family)",
)


def lora_stack(
    shape: tuple[str, int, int, int],
    *,
    device: str | torch.device = "cuda",
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[SynthStack, dict]:
    """The stack of ``shape`` (an entry of :data:`memfit_benchmarks.shapes.SHAPES`: label, width, depth, tokens) in
    ``dtype`` on ``device`` with PEFT LoRA on every block linear (the sweeps' ``lora-all``), and its seeded batch."""
    _, width, depth, tokens = shape
    model = build(dim=width, depth=depth, dtype=dtype, device=device)
    batch = inputs(model, tokens=tokens, generator=torch.Generator().manual_seed(0))
    prepare(model, batch, TrainingConfig.LORA_ALL, SYNTHETIC, dtype=dtype)
    return model, batch
