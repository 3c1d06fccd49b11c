"""Where the model trains: ``memfit.apply(model, config, device=...)`` moves it there; ``remove()`` moves it back.

Design notes (``docs/weight-streaming.md``, "A model that starts on the host")
-----------------------------------------------------------------------------
Why apply moves the model.  A model larger than the card is loaded on the CPU; ``model.to("cuda")`` before
``apply`` would run out of memory before any weight could stream. So ``apply`` moves it: the frozen weights of the
blocks that stream go from where they are into their host masters (the streamer's job), everything else goes to
the device here. The streamer runs first, so the device never holds more than the resident part.

Undo.  Each tensor moved here keeps its home (its device before ``apply``); :meth:`Placement.undo` moves the tensor
as it is now back there, so after ``remove()`` the model is where it was, with the values training gave it. Where
everything moved came from one device (a model loaded on the CPU), a tensor added on the device since (LoRA added
after ``apply``) goes there too: a model left half on the GPU could not run. Tensors that were on the device
before ``apply`` stay.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from memfit.distributed import is_fsdp_module
from memfit.errors import ConfigError, DeviceMemoryError, NotAvailableError
from memfit.units import format_bytes


def target_device(device: torch.device | str | int | None) -> torch.device | None:
    """``apply``'s ``device`` checked: None, the CPU, or an available CUDA device (an index means ``cuda:index``).

    Raises:
        ConfigError: not a device torch knows, or one memfit does not train on.
        NotAvailableError: a CUDA device this process cannot see.
    """
    if device is None:
        return None
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(
            f"memfit.apply(..., device={device!r}): not a device ({exc}). Pass where the model trains, e.g. "
            f"device='cuda' or device='cuda:1'."
        ) from None
    if target.type not in ("cpu", "cuda"):
        raise ConfigError(
            f"memfit.apply(..., device={device!r}): memfit trains on 'cuda' or 'cpu', not {target.type!r}."
        )
    if target.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if target.index is None:
            target = torch.device("cuda", torch.cuda.current_device()) if count else target
        if not count or target.index >= count:
            raise NotAvailableError(
                f"memfit.apply(..., device={device!r}): this process sees {count} CUDA device(s). Check "
                f"CUDA_VISIBLE_DEVICES and the driver, or pass device='cpu'."
            )
    return target


def check_movable(model: nn.Module, device: torch.device) -> None:
    """``model`` can be moved to ``device`` tensor by tensor.

    Raises:
        NotAvailableError: the model is sharded with FSDP2 (each rank's shards are placed by FSDP itself).
        ConfigError: a parameter or buffer is on the meta device (not loaded).
    """
    if any(is_fsdp_module(m) for m in model.modules()):
        raise NotAvailableError(
            f"memfit.apply(..., device='{device}') moves the model's tensors one by one, but this model is "
            f"sharded with FSDP2 (fully_shard), which places each rank's shards itself. Leave device out: "
            f"memfit trains an FSDP2 model where its shards are."
        )
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.device.type == "meta":
            raise ConfigError(
                f"memfit.apply(..., device='{device}'): {name} is on the meta device (its values were never "
                f"loaded: init_empty_weights, device_map, low_cpu_mem_usage?). Load the weights first, to the CPU "
                f"if the card cannot hold them, then apply."
            )


@dataclass
class Placement:
    """The tensors :meth:`move` moved to ``device``, each with its home.

    Example:
        >>> placement = Placement.move(model, torch.device("cuda"))  # doctest: +SKIP
        >>> ...  # train
        >>> placement.undo()  # doctest: +SKIP
    """

    model: nn.Module
    device: torch.device
    parameters: list[tuple[nn.Parameter, torch.device]] = field(default_factory=list)
    buffers: list[tuple[nn.Module, str, torch.device]] = field(default_factory=list)
    # by id, the tensors on the device before the move (weak: identity checked, never tensor equality)
    there_before: dict[int, weakref.ref] = field(default_factory=dict)

    @classmethod
    def move(
        cls,
        model: nn.Module,
        device: torch.device,
        *,
        profiles: bool = False,
        streamed: Mapping[int, torch.device] | None = None,
    ) -> Placement:
        """Every parameter (with its gradient) and buffer of ``model`` that is not on ``device``, moved there.

        Args:
            model: the model.
            device: where it trains.
            streamed: by parameter id, the home of each weight streaming now (its placeholder is on ``device``):
                recorded as moved from there, so that a block a later plan stops streaming, whose weights then
                come to the device, goes home on :meth:`undo` too.
            profiles: ``auto`` plans it and chose to profile it with every weight on the device (the error says
                when it streams instead).

        Raises:
            DeviceMemoryError: the device ran out of memory; what had moved is back where it was.
        """
        placement = cls(model, device)
        try:
            placement._move(model, streamed or {})
        except torch.OutOfMemoryError:
            placement.undo()
            staying = _storage_bytes(model)
            free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
            where = f"do not fit on {device} ({format_bytes(free)} free)"
            if profiles:
                fix = (
                    "gradient_checkpointing_backend='auto' profiles the model with every weight on the device "
                    "where they fit in half of what the process can hold, and streams some from host memory "
                    "otherwise, unless gradient_checkpointing_stream_blocks is 0. Unset "
                    "gradient_checkpointing_stream_blocks, free memory on the device, or use a larger one."
                )
            else:
                fix = (
                    "Stream more blocks' weights from host memory (gradient_checkpointing_stream_blocks, a count "
                    'or a size such as "8GiB"), or train on a larger device.'
                )
            raise DeviceMemoryError(
                f"memfit.apply(..., device='{device}'): the model's weights and buffers that stay on the device "
                f"({format_bytes(staying)}) {where}. {fix} The model is where it was."
            ) from None
        return placement

    def _move(self, model: nn.Module, streamed: Mapping[int, torch.device]) -> None:
        seen: set[int] = set()
        for module in model.modules():
            for p in module._parameters.values():
                if p is None or id(p) in seen:
                    continue
                seen.add(id(p))
                if id(p) in streamed:
                    # its placeholder is on the device already; its weight lives at its home
                    self.parameters.append((p, streamed[id(p)]))
                elif p.device == self.device:
                    self.there_before[id(p)] = weakref.ref(p)
                else:
                    self.parameters.append((p, p.device))  # first: an out-of-memory move is undone too
                    _move_parameter(p, self.device)
            for name, buf in module._buffers.items():
                if buf is None:
                    continue
                if buf.device == self.device:
                    self.there_before[id(buf)] = weakref.ref(buf)
                else:
                    module._buffers[name] = buf.to(self.device)
                    self.buffers.append((module, name, buf.device))

    def homes(self) -> dict[int, torch.device]:
        """By parameter id, where each parameter :meth:`move` moved was before."""
        return {id(p): home for p, home in self.parameters}

    def undo(self) -> None:
        """Every tensor :meth:`move` moved back on its home device, as it is now, and where they all came from one
        device, the tensors added on the device since (see "Undo"). Idempotent."""
        homes = {home for _, home in self.parameters} | {home for *_, home in self.buffers}
        for p, home in reversed(self.parameters):
            _move_parameter(p, home)
        for module, name, home in reversed(self.buffers):
            buf = module._buffers.get(name)
            if buf is not None:
                module._buffers[name] = buf.to(home)
        if len(homes) == 1:
            (home,) = homes
            recorded = {id(p) for p, _ in self.parameters}
            for module in self.model.modules():
                for p in module._parameters.values():
                    if p is None or id(p) in recorded:
                        continue
                    if p.device == self.device and not self._was_there(p):
                        _move_parameter(p, home)
                for name, buf in module._buffers.items():
                    if buf is not None and buf.device == self.device and not self._was_there(buf):
                        module._buffers[name] = buf.to(home)
        self.parameters.clear()
        self.buffers.clear()

    def _was_there(self, t: torch.Tensor) -> bool:
        ref = self.there_before.get(id(t))
        return ref is not None and ref() is t


def _move_parameter(p: nn.Parameter, device: torch.device) -> None:
    p.data = p.data.to(device)
    if p.grad is not None:
        p.grad = p.grad.to(device)


def _storage_bytes(model: nn.Module) -> int:
    """Bytes of the distinct storages under ``model``'s parameters and buffers (a streamed weight's placeholder
    is one element)."""
    storages: dict[Any, int] = {}
    for t in [*model.parameters(), *model.buffers()]:
        storage = t.untyped_storage()
        storages[(t.device, storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())
