"""The adapter protocol: a family *declares* its boundaries, the core executes.

An adapter never runs model code of its own and never edits the model.  It says:

* which ``nn.ModuleList`` attributes hold the repeated blocks, in call order;
* for each block class, the FFN region(s) and the attention region(s), each a chain
  of consecutive sub-module calls given by attribute path (``("proj_mlp", "act_mlp")``);
* whether whole-block interval chunks are safe for the family;
* a checkpointing switch of the model's own, if it has one besides diffusers' flags;
* which diffusers versions it was verified against;
* presets: factories for a model and matching dummy inputs (a tiny one for tests and
  the CLI, the published full size for benchmarks).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from memfit.plan import BlockEntry

# A region is a chain of consecutive sub-module calls inside a block, by attribute path.
Region = tuple[str, ...]


@dataclass(frozen=True)
class BlockSpec:
    """Boundaries of one block class.

    Args:
        ffn: FFN regions. Each region is a chain of sub-module paths called one after the
            other with nothing in between that needs their activations, e.g. ``("ff",)`` or
            ``("proj_mlp", "act_mlp")``. Empty: this block has no safe FFN boundary.
        attention: attention regions (for attention offload), same form.
        attention_without_sdpa: why this block's attention regions call no
            ``torch.nn.functional.scaled_dot_product_attention`` (e.g. ``"flash_attn_varlen_func"``).
            Empty (the default): the conformance kit requires an SDPA call in each attention region, which
            catches a module declared as attention that is not one.
    """

    ffn: tuple[Region, ...] = ()
    attention: tuple[Region, ...] = ()
    attention_without_sdpa: str = ""


@dataclass(frozen=True)
class CheckpointSwitch:
    """A model's own checkpointing switch, besides diffusers' ``gradient_checkpointing`` flags: on, the model's
    forward checkpoints its blocks itself (Mage-Flow's ``checkpoint``: ``torch.utils.checkpoint`` per block).

    While memfit enters the blocks through forward hooks, a switch that is on is turned off (one
    ``MemfitWarning``; ``remove()`` restores it exactly): memfit's regions would otherwise run nested inside the
    model's own checkpoint calls and pay recompute for nothing. Where memfit routes blocks through the model's
    ``enable_gradient_checkpointing(gradient_checkpointing_func=...)``, the switch is left as that method sets it:
    it then gates the branch that calls memfit's function.

    Args:
        attribute: the model attribute holding the switch (``"checkpoint"``); empty: none.
        config_key: the key of the model's config holding it (``"checkpoint"``); empty: none.

    Raises:
        ValueError: neither is given, or one is not a Python identifier.

    Example:
        >>> CheckpointSwitch(attribute="checkpoint", config_key="checkpoint")
    """

    attribute: str = ""
    config_key: str = ""

    def __post_init__(self) -> None:
        if not self.attribute and not self.config_key:
            raise ValueError(
                "CheckpointSwitch needs the model attribute and/or the config key of the switch, e.g. "
                "CheckpointSwitch(attribute='checkpoint', config_key='checkpoint')"
            )
        for what, name in (("attribute", self.attribute), ("config_key", self.config_key)):
            if name and not (isinstance(name, str) and name.isidentifier()):
                raise ValueError(
                    f"CheckpointSwitch.{what} must be one attribute name of the model (or its config), got {name!r}"
                )


@dataclass(frozen=True)
class PixelGrid:
    """How a training resolution becomes the token count a preset's ``inputs`` takes.

    Args:
        pixels_per_token: pixels along each image axis that one token covers: the VAE's spatial downsampling
            times the patch size (Flux: 8 x 2 = 16, so 1024x1024 px is 64 x 64 = 4096 tokens).
        frames_per_latent: video families: pixel frames per latent frame (the VAE's temporal compression).
            Causal video VAEs encode the first frame alone, so ``F`` frames become ``(F - 1) / k + 1`` latent
            frames and ``F - 1`` must be a multiple of ``k``. None: an image family.

    Example:
        >>> PixelGrid(16).tokens(1024, 768)
        3072
        >>> PixelGrid(16, frames_per_latent=4).tokens(832, 480, frames=81)  # Wan 480p, 81 frames
        32760
    """

    pixels_per_token: int
    frames_per_latent: int | None = None

    @property
    def video(self) -> bool:
        return self.frames_per_latent is not None

    def tokens(self, width: int, height: int, frames: int | None = None) -> int:
        """Tokens of one sample at ``width x height`` (and ``frames``, for video).

        Raises:
            ValueError: a side is not a multiple of ``pixels_per_token``, frames are missing for video (or
                given for an image family), or ``frames - 1`` is not a multiple of ``frames_per_latent``.
        """
        step = self.pixels_per_token
        for name, side in (("width", width), ("height", height)):
            if side < step or side % step:
                lower, upper = max(step, side // step * step), (side // step + 1) * step
                raise ValueError(
                    f"{name} {side} px is not a multiple of {step} (one token covers {step}x{step} px); "
                    f"use {lower} or {upper}"
                )
        spatial = (width // step) * (height // step)
        if self.frames_per_latent is None:
            if frames is not None:
                raise ValueError("this is an image family: it takes a resolution, not frames")
            return spatial
        k = self.frames_per_latent
        if frames is None:
            raise ValueError(f"a video family needs the frame count too (e.g. {4 * k + 1} frames)")
        if frames < 1 or (frames - 1) % k:
            below = max(1, (frames - 1) // k * k + 1)
            raise ValueError(
                f"{frames} frames: the VAE encodes the first frame, then {k} frames per latent frame, so the "
                f"count must be 1 + a multiple of {k}; use {below} or {below + k}"
            )
        return ((frames - 1) // k + 1) * spatial


@dataclass(frozen=True)
class Preset:
    """A model size users train at, with inputs that drive one forward.

    Args:
        build: ``build(dtype=..., device=...) -> nn.Module`` with random weights (nothing is downloaded).
        inputs: ``inputs(model, *, tokens, batch, generator) -> dict`` of forward kwargs. ``tokens`` is
            the image-token count the family packs latents into (the family rounds it to a valid shape).
        default_tokens: the token count used when the caller does not choose one.
        description: a short human label (``"Flux.1-dev, 12B"``).
        pixels: how a resolution (and frame count) becomes ``tokens`` (``memfit fit --resolution``); None for
            families whose inputs are not images (text encoders take ``--tokens``).
    """

    build: Callable[..., nn.Module]
    inputs: Callable[..., dict[str, Any]]
    default_tokens: int = 256
    description: str = ""
    pixels: PixelGrid | None = None


def default_loss(output: Any) -> torch.Tensor:
    """A scalar to backpropagate from a model output (diffusers output object, tuple or tensor)."""
    if hasattr(output, "sample"):
        output = output.sample
    if isinstance(output, (tuple, list)):
        output = output[0]
    return output.float().pow(2).mean()


@dataclass(frozen=True)
class FamilyAdapter:
    """Everything the core needs to know about one model family.

    Args:
        name: the family's name as users type it (``"flux"``).
        model_classes: class names this adapter serves; matched against the model's MRO, so
            user subclasses match too.
        block_lists: attribute paths of the ``nn.ModuleList`` s holding the repeated blocks,
            in the order the model calls them.
        blocks: block class name -> its :class:`BlockSpec`.
        supports_interval: whether consecutive blocks may be checkpointed as one chunk.
        verified_versions: library -> the versions the declarations were verified against
            (``{"diffusers": ("0.42.1",)}``; a transformers model names transformers).
        block_count_config: block list path -> the model-config key holding its length, so the
            kit can check that the declared lists match the configuration.
        presets: named :class:`Preset` s; ``"tiny"`` is required (tests and CLI default).
        loss: maps a forward's output to a scalar loss.
        notes: free text shown by ``memfit list`` (what was verified, what is missing and why).
        block_entry: how block calls reach the engine (:class:`memfit.plan.BlockEntry`). ``AUTO``: through
            diffusers' ``gradient_checkpointing_func`` where the model supports it (plus forward hooks on the
            declared blocks for lists the model does not route); ``HOOKS``: forward hooks only, and the
            model's own checkpointing branch is never switched on — for models whose checkpointing branch
            does not call blocks the same way as the normal one (e.g. drops an argument). The strings
            ``"auto"``/``"hooks"`` are accepted.
        model_checkpoint_switch: the model's own checkpointing switch (:class:`CheckpointSwitch`), if it has one
            besides diffusers' flags; None: it has none.
    """

    name: str
    model_classes: tuple[str, ...]
    block_lists: tuple[str, ...]
    blocks: Mapping[str, BlockSpec]
    supports_interval: bool = True
    verified_versions: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    block_count_config: Mapping[str, str] = field(default_factory=dict)
    presets: Mapping[str, Preset] = field(default_factory=dict)
    loss: Callable[[Any], torch.Tensor] = default_loss
    notes: str = ""
    block_entry: BlockEntry = BlockEntry.AUTO
    model_checkpoint_switch: CheckpointSwitch | None = None

    def __post_init__(self) -> None:
        if self.block_entry not in (BlockEntry.AUTO, BlockEntry.HOOKS):
            raise ValueError(f"FamilyAdapter.block_entry must be 'auto' or 'hooks', got {self.block_entry!r}")
        object.__setattr__(self, "block_entry", BlockEntry(self.block_entry))
        for library, versions in self.verified_versions.items():
            if (
                not isinstance(library, str)
                or isinstance(versions, str)
                or not all(isinstance(v, str) for v in versions)
            ):
                raise ValueError(
                    f"FamilyAdapter.verified_versions maps a library to a tuple of versions, e.g. "
                    f"{{'diffusers': ('0.42.1',)}}; got {library!r}: {versions!r}"
                )
        switch = self.model_checkpoint_switch
        if switch is not None and not isinstance(switch, CheckpointSwitch):
            hint = f"; e.g. CheckpointSwitch(attribute={switch!r})" if isinstance(switch, str) else ""
            raise ValueError(
                f"FamilyAdapter.model_checkpoint_switch must be a CheckpointSwitch (or None), got {switch!r}{hint}"
            )

    # -- queries -----------------------------------------------------------------------------------------------

    def matches(self, model: nn.Module) -> bool:
        names = {cls.__name__ for cls in type(model).__mro__}
        return any(name in names for name in self.model_classes)

    def spec_for(self, block: nn.Module) -> BlockSpec | None:
        """The declared :class:`BlockSpec` of ``block``'s class, looked up along its MRO (so wrappers that
        subclass the block's class, such as FSDP2's ``fully_shard``, still match); None if undeclared."""
        for cls in type(block).__mro__:
            spec = self.blocks.get(cls.__name__)
            if spec is not None:
                return spec
        return None

    def ffn_chains(self, block: nn.Module) -> list[list[nn.Module]]:
        """``block``'s FFN regions, each as its chain of modules (empty if the block is undeclared)."""
        spec = self.spec_for(block)
        return [] if spec is None else [[block.get_submodule(p) for p in region] for region in spec.ffn]

    def attention_modules(self, block: nn.Module) -> list[nn.Module]:
        """The modules of ``block``'s attention regions (empty if the block is undeclared)."""
        spec = self.spec_for(block)
        return [] if spec is None else [block.get_submodule(p) for region in spec.attention for p in region]

    @property
    def has_ffn(self) -> bool:
        return any(spec.ffn for spec in self.blocks.values())

    @property
    def has_attention(self) -> bool:
        return any(spec.attention for spec in self.blocks.values())

    def scopes(self) -> list[str]:
        """Human-readable list of what this family supports, for ``memfit list``."""
        out = ["torch", "unsloth"]
        if self.has_ffn:
            out += ["torch-ffn", "unsloth-ffn"]
        if self.supports_interval:
            out.append("interval")
        out.append("stride")
        if self.has_attention:
            out.append("offload_attention")
        return out

    def resolve_block_lists(self, model: nn.Module) -> dict[str, nn.ModuleList]:
        """The declared block lists present on ``model``, in call order.

        A declared list whose attribute is ``None`` is skipped: some configurations build a list
        only when a feature is on (e.g. Z-Image's ``siglip_refiner``). A path that does not exist
        at all is an error (a typo in the declaration).
        """
        lists: dict[str, nn.ModuleList] = {}
        for path in self.block_lists:
            parent_path, _, name = path.rpartition(".")
            parent = model.get_submodule(parent_path) if parent_path else model
            if not hasattr(parent, name):
                raise AttributeError(
                    f"family {self.name!r} declares block list {path!r}, which "
                    f"{type(model).__name__} does not have"
                )
            container = getattr(parent, name)
            if container is None:
                continue
            lists[path] = container
        return lists

    def iter_blocks(self, model: nn.Module):
        """Yield ``(list_path, index, block)`` for every declared block present, in call order."""
        for path, container in self.resolve_block_lists(model).items():
            for index, block in enumerate(container):
                yield path, index, block
