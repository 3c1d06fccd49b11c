"""A small non-diffusers transformer stack and its adapter, for engine tests that need no diffusers."""

from __future__ import annotations

import torch
from torch import nn

from memfit import BlockSpec, FamilyAdapter, Preset


class ToyBlock(nn.Module):
    def __init__(self, dim: int, dropout: float = 0.0, edit_input: bool = False) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.ff_in = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU(approximate="tanh")
        self.ff_out = nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(dropout)
        self.edit_input = edit_input
        self.fail = False

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        if self.fail:
            raise RuntimeError("planted failure")
        if self.edit_input:
            x.mul_(1.0)
        x = x + self.attn(self.norm1(x)) * scale
        return x + self.drop(self.ff_out(self.act(self.ff_in(self.norm2(x)))))


class ToyModel(nn.Module):
    def __init__(self, blocks: int = 6, dim: int = 16, dropout: float = 0.0) -> None:
        super().__init__()
        self.proj_in = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(ToyBlock(dim, dropout) for _ in range(blocks))
        self.proj_out = nn.Linear(dim, dim)

    def forward(
        self, hidden_states: torch.Tensor, residuals: list[torch.Tensor] | None = None
    ) -> torch.Tensor:
        scale = torch.sigmoid(self.proj_in.bias.sum())  # one tensor shared by every block
        x = self.proj_in(hidden_states)
        for i, block in enumerate(self.blocks):
            x = block(x, scale)
            if residuals is not None:
                x = x + residuals[i]  # controlnet-style edit between two block calls
        return self.proj_out(x)


def build(*, dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0, **kw) -> ToyModel:
    torch.manual_seed(seed)
    return ToyModel(**kw).to(device=device, dtype=dtype)


def inputs(model: ToyModel, *, tokens: int = 8, batch: int = 2, generator=None) -> dict:
    dim = model.proj_in.in_features
    return {"hidden_states": torch.randn(batch, tokens, dim, generator=generator)}


TOY = FamilyAdapter(
    name="toy",
    model_classes=("ToyModel",),
    block_lists=("blocks",),
    blocks={"ToyBlock": BlockSpec(ffn=(("ff_in", "act", "ff_out"),), attention=(("attn",),))},
    supports_interval=True,
    presets={"tiny": Preset(build=build, inputs=inputs, default_tokens=8)},
)


def loss_of(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()
