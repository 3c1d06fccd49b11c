"""The controller: one pair of model hooks that drives the current installation, and re-plans when asked.

Every applied model has one. A fixed backend's planner returns the same plan for every input, so the plan
installed at ``apply`` stays; ``auto``'s planner (:class:`memfit.auto.budget_planner.BudgetPlanner`) gives
each input signature (shapes, dtypes, scalar arguments) its own plan. When a forward with gradients brings
a new signature, the controller takes the current installation off, lets the planner plan on the bare
model (``auto`` profiles it), installs the new plan, and lets the forward proceed. The installations are
built without model hooks of their own (so swapping them inside a model hook never adds or removes hooks
of the module being called); the controller forwards the start and end of each forward to the current one.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Hashable, Mapping
from typing import Any, Protocol

import torch
from torch import nn

from memfit.adapters.spec import FamilyAdapter
from memfit.engine import state
from memfit.engine.frame import FrameStats
from memfit.engine.hooks import Attached, on_first_gradient, queue_at_backward_end
from memfit.install import Installation, install, streamed_modules
from memfit.offload.session import OffloadSession
from memfit.offload.weights import WeightStreamer, first_weight_device, stream_api_for
from memfit.placement import Placement
from memfit.plan import RegionPlan


class Planner(Protocol):
    """Chooses the plan for a forward's inputs."""

    # plans depend on the inputs: the controller asks for a signature at each forward with gradients
    adaptive: bool

    def signature(self, args: tuple, kwargs: dict) -> Hashable:
        """What a plan depends on, for these forward arguments."""

    def plan_for(self, signature: Hashable, args: tuple, kwargs: dict) -> RegionPlan:
        """The plan for a new signature; called with nothing installed on the model."""

    def kept_bytes(self) -> Mapping[str, int] | None:
        """Per block name, what a block that keeps everything holds under the latest plan (or None)."""

    def step_finished(self, signature: Hashable) -> None:
        """The step of ``signature``'s latest forward ended (a forward with gradients begins)."""

    def forward_ended(self, signature: Hashable) -> bool:
        """A forward with gradients of ``signature`` ended (``auto`` notes the bytes allocated then). True: call
        :meth:`backward_ended` when the backward through this forward's output ends."""

    def backward_ended(self, signature: Hashable) -> None:
        """The backward through the output of a forward for which :meth:`forward_ended` said True ended."""

    def replan_wanted(self, signature: Hashable) -> bool:
        """The plan of ``signature`` changed since it was installed (``auto``'s closed loop)."""

    def needs_bare_model(self, signature: Hashable) -> bool:
        """:meth:`plan_for` runs the model (``auto`` profiles a new signature): every weight must be in place."""

    def profiling_plan(self, device: torch.device) -> RegionPlan | None:
        """For a model that starts on the host and whose weights the card cannot hold: a plan streaming enough
        blocks' weights for :meth:`plan_for` to profile it on ``device`` (None: not needed, or this planner
        cannot)."""

    def installed(self, signature: Hashable) -> None:
        """The plan for ``signature`` is installed (``auto`` starts measuring its steps from here)."""

    def describe(self) -> str:
        """One line or more for :meth:`memfit.MemfitHandle.describe`."""


class FixedPlanner:
    """A fixed backend's planner: one plan, whatever the inputs."""

    adaptive = False

    def __init__(self, plan: RegionPlan) -> None:
        self.plan = plan

    def signature(self, args: tuple, kwargs: dict) -> Hashable:
        return None

    def plan_for(self, signature: Hashable, args: tuple, kwargs: dict) -> RegionPlan:
        return self.plan

    def kept_bytes(self) -> Mapping[str, int] | None:
        return None

    def step_finished(self, signature: Hashable) -> None:
        return None

    def forward_ended(self, signature: Hashable) -> bool:
        return False

    def backward_ended(self, signature: Hashable) -> None:
        return None

    def replan_wanted(self, signature: Hashable) -> bool:
        return False

    def needs_bare_model(self, signature: Hashable) -> bool:
        return False

    def profiling_plan(self, device: torch.device) -> RegionPlan | None:
        return None

    def installed(self, signature: Hashable) -> None:
        return None

    def describe(self) -> str:
        return ""


class Controller:
    """Owns the model hooks of one applied model and the installation of its current plan.

    Args:
        model: the model.
        adapter: its family adapter (None: the generic diffusers path).
        planner: chooses the plans.
        initial: the plan installed now (a fixed backend's; ``auto``: one that keeps everything).
        session: the offload session shared by every plan, or None.
        device: where the model trains when ``apply`` was told (``apply(..., device=)``), else None (where the
            weights are). Given, the initial plan's streamed weights go to host memory from where they are, then
            everything else moves to ``device`` (:class:`~memfit.placement.Placement`; moved back on
            :meth:`remove`). Under ``auto``, a model whose weights the device cannot hold starts with the
            planner's :meth:`~Planner.profiling_plan` streaming, and new input shapes are profiled while it streams
            (docs/weight-streaming.md, "A model that starts on the host").

    Raises:
        DeviceMemoryError: what stays on ``device`` does not fit there (nothing is left moved or installed).
    """

    def __init__(
        self,
        model: nn.Module,
        adapter: FamilyAdapter | None,
        planner: Planner,
        *,
        initial: RegionPlan,
        session: OffloadSession | None,
        device: torch.device | None = None,
    ) -> None:
        self.model = model
        self.device = device
        self.placement: Placement | None = None
        # auto profiles with weights streaming (the card cannot hold them all)
        self.profiles_streaming = False
        self.adapter = adapter
        self.planner = planner
        self.session = session
        self.stats = FrameStats()  # one set of counters across re-plans
        self.replans = 0
        self._signature: Hashable = None
        self._local = threading.local()  # per thread: a forward of this model is running (depth)
        self._handles: list[Any] = []
        # streams the current plan's streamed blocks; outlives re-plans, so host masters are made once per block
        self.streamer: WeightStreamer | None = None
        try:
            self.installation = self._install(initial)
            if device is not None:  # after the streamer took its weights: the device holds the rest only
                self.placement = self._place(device)
        except BaseException:
            if hasattr(self, "installation"):
                self.installation.remove()
            self._release_weights()
            raise
        self._handles.append(model.register_forward_pre_hook(Attached(self._pre), with_kwargs=True))
        self._handles.append(model.register_forward_hook(Attached(self._post), always_call=True))

    def keep_until_removed(self, handle: Any) -> None:
        """Remove ``handle`` (a hook of a helper such as the FSDP2 order guard) together with this controller."""
        self._handles.append(handle)

    def remove(self) -> None:
        self._undo_interrupted()
        self.installation.remove()
        self._release_weights()
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _place(self, device: torch.device) -> Placement:
        """Everything not streamed moved to ``device``; under ``auto``, weights the device cannot hold for the
        profile stream from the host first (:meth:`Planner.profiling_plan`)."""
        profiling = self.planner.profiling_plan(device) if self.planner.adaptive else None
        if profiling is not None:
            self.installation.remove()
            # its blocks' weights go to host memory from where they are, before anything else moves
            self.installation = self._install(profiling)
            self.profiles_streaming = True
        streamed = self.streamer.homes() if self.streamer is not None else None
        return Placement.move(
            self.model, device, profiles=self.planner.adaptive and profiling is None, streamed=streamed
        )

    def _release_weights(self) -> None:
        """Streamed weights back where they were (a weight ``apply`` moved to the device and a later plan streamed:
        straight back to the host), then the rest of what ``apply`` moved."""
        if self.streamer is not None:
            self.streamer.remove(homes=self.placement.homes() if self.placement is not None else None)
            self.streamer = None
        if self.placement is not None:
            self.placement.undo()

    def _install(self, plan: RegionPlan) -> Installation:
        return install(
            self.model,
            self.adapter,
            plan,
            stats=self.stats,
            session=self.session,
            kept_bytes=self.planner.kept_bytes(),
            streamer=self._streamer_for(plan),
        )

    def _streamer_for(self, plan: RegionPlan) -> WeightStreamer | None:
        """The streamer, pointed at ``plan``'s streamed blocks (made on first need; freed when none stream)."""
        modules = streamed_modules(self.model, self.adapter, plan)
        if not modules:
            if self.streamer is not None:
                self.streamer.retarget([])  # their weights back on the device the model trains on
                self.streamer = None
            return None
        if self.streamer is None:
            device = self.device or first_weight_device(modules)
            self.streamer = WeightStreamer(
                self.model, modules, device=device, streams=stream_api_for(device), keep_last=True
            )
        else:  # installed: only the blocks that change move (no round trip of every weight through the device)
            self.streamer.retarget(modules)
        self.streamer.keep_first = plan.uploads_kept_first
        self.streamer.forward_ahead = plan.forward_uploads_ahead
        return self.streamer

    # -- model hooks --------------------------------------------------------------------------------------------

    def _pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        depth = getattr(self._local, "depth", 0)
        if depth:  # the last forward on this thread never ended (interrupted): start clean
            self._undo_interrupted()
        self._local.depth = 1
        if self.planner.adaptive and torch.is_grad_enabled():
            if self._signature is not None:
                self.planner.step_finished(self._signature)
            signature = self.planner.signature(args, kwargs)
            if signature != self._signature or self.planner.replan_wanted(signature):
                self._switch(signature, args, kwargs)
        self.installation.begin_forward()

    def _post(self, module: nn.Module, args: tuple, output: Any) -> None:
        self._local.depth = 0
        failed = output is None and sys.exc_info()[0] is not None
        self.installation.end_forward(failed=failed)
        signature = self._signature
        measured = self.planner.adaptive and torch.is_grad_enabled() and not failed and signature is not None
        if measured and self.planner.forward_ended(signature):
            _when_backward_ends(output, lambda: self.planner.backward_ended(signature))

    def _undo_interrupted(self) -> None:
        """Undo what an interrupted forward left on this thread (``KeyboardInterrupt`` skips the hooks that
        would): its region calls' saved-tensor hooks, the engine's open frames, and its step, ended as failed (the
        offload session gives back the tensors still waiting to be parked and the step's host buffers now: after
        ``remove()`` no later forward would)."""
        state.undo_open_calls()
        self.installation.engine.forget_open_calls()
        if getattr(self._local, "depth", 0):
            self._local.depth = 0
            self.installation.end_forward(failed=True)

    def _switch(self, signature: Hashable, args: tuple, kwargs: dict) -> None:
        current = self.installation.plan
        self.installation.remove()
        profiling = self.streamer is not None and self.planner.needs_bare_model(signature)
        if profiling and not self.profiles_streaming:
            self.streamer.suspend()  # profiling runs the model with its weights in place
        plan = None
        streaming = self.streamer.profiling() if profiling and self.profiles_streaming else None
        try:
            with streaming or contextlib.nullcontext():
                plan = self.planner.plan_for(signature, args, kwargs)
        finally:  # a planning error (BudgetError) leaves the previous plan installed, never a half-removed one
            self.installation = self._install(plan if plan is not None else current)
        self._signature = signature
        self.replans += 1
        self.planner.installed(signature)


def _when_backward_ends(output: Any, callback: Callable[[], None]) -> None:
    """Run ``callback`` once, when the first backward that reaches one of ``output``'s tensors ends (queued with the
    autograd engine as the first gradient arrives)."""
    on_first_gradient(output, lambda: queue_at_backward_end(callback))
