"""The cheapest per-block plan whose predicted peak fits a memory budget.

Design notes
------------
Peak model.  Memory is highest while some block's backward runs. Then the blocks before it in forward
order still hold what they keep, the blocks after it have released theirs, and the block itself has all
its activations back (kept, recomputed or reloaded). So block *b* under a plan needs ::

    static + outside + Σ_{j<b} kept(j) + own(b) + grads after b + reloaded ahead

where ``outside`` is what is saved before the blocks, after the last one, or shared between them,
``kept(j)`` includes what the layers between block *j* and the next one save (freed as backward passes
them, before the blocks before them; see "Head" for the layers after the last block), and ``own(b)`` is
the peak of one forward+backward of the block alone, measured in the profile with everything it saves
held (so it carries the backward's gradient buffers and the attention kernel's own temporaries), plus its
inputs, adjusted by what the policy keeps or brings back beyond what the block saves.
``grads after b``: the trainable weights of the blocks after it (and outside every block) have their
gradients by then. ``reloaded ahead``: what the copy engine brings back for the blocks backward visits
next, by its own rule (the next block that copies, a second when the first is the smaller); a block whose
only parked regions are its attention calls issues that reload when its attention's backward begins, so
there the term is ``max(own(b), own from then on + reloaded ahead)``. The forward's
end adds one more bound, ``Σ kept + the working memory outside the blocks``. Off CUDA the budget counts the
bytes held when backward begins: ``outside + Σ kept``.

Head.  What the layers after the last block save (an output norm saving the last block's output) is freed
before any block's backward runs, yet the planner holds it throughout: their own backward, not measured,
can need more than their forward's working memory (Wan's output norm runs in fp32). Left out of the blocks'
terms, the smallest Wan plan was predicted 0.29 GiB below its measured peak and ran 42 MiB over its budget
(H200, c8ad640); held, it matched ``unsloth`` exactly, and on Flux and the synthetic stack, whose heads
are small, the smallest peak is one block output (26, 24 MiB) above ``unsloth``'s.

Cost model.  Extra seconds per block: recomputed FLOPs at the profiled rate, plus copy time not hidden
behind compute (a device→host copy overlaps the block's forward, as long with gradients as the isolated
block runs measured, the reload its backward, taken as
``backward_to_forward`` times as long: timed on the isolated block runs on CUDA, 1.5-2 with a frozen base
and LoRA on an H200; elsewhere the FLOP ratio, a lower bound, so exposure is overcharged rather than hidden),
plus host-side bookkeeping: a fixed cost per region and, for attention offload, per tensor saved inside
the attention call (each goes through Python pack and fetch hooks: a Flux double block saves 69 under PEFT
LoRA, a synthetic block 15), the constants below, from the H200 sweeps. FFN recompute is priced at the FFN
regions' own FLOP rate where one was timed (CUDA), block recompute at the blocks'. The fixed costs are
converted to FLOPs at a nominal rate of the device kind, so that without copies or an FFN rate every cost
is FLOPs over one measured rate and the plan does not depend on that measurement at all; otherwise it
depends on the measured rates only through their snapped values (:func:`memfit.auto.profile.round_rate`).

Search.  :mod:`memfit.auto.search`: a dynamic programme over the blocks in forward order whose state is
the kept bytes so far (in units of 1/1024 of the total, rounded up: never optimistic) and the two nearest
copies before the block (what is reloaded ahead of it), exact under this model up to the units. It answers
the cheapest plan within the budget and the smallest peak any plan reaches. Ties go to the less intrusive
policy (``BlockPolicy`` order): the same profile and budget always give the same plan.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from memfit.auto import search
from memfit.auto.policy import BlockPolicy
from memfit.auto.profile import BlockProfile, ModelProfile
from memfit.errors import BudgetError
from memfit.offload.session import PREFETCH_DEPTH
from memfit.units import format_bytes

RECOMPUTE_REGION_SECONDS = 50e-6  # hooks, frame bookkeeping, replay per recomputed region
# plus events, pool and stream bookkeeping per parked region: the synthetic stack at 4096 tokens (H200,
# 709d1e4) measured 0.02 ms (unsloth-ffn over torch-ffn) to 0.05 ms (unsloth over torch) per region
OFFLOAD_REGION_SECONDS = 50e-6
# per tensor saved inside an offloaded attention call, parked or not: the pack hook in forward and the fetch
# in backward. Under PEFT LoRA a Flux double block's attention saves 69 tensors, a single block 34, a
# synthetic block 15; Flux's offload_attention ran ~70 ms over none at 4096 tokens (f8299cb), of which
# copies exposed ~8 ms: ~20 us per tensor where the forward is host-bound
HOOKED_TENSOR_SECONDS = 10e-6
NOMINAL_FLOPS_PER_SECOND = {"cuda": 4e14, "cpu": 5e10}  # converts the fixed costs above to FLOPs
_UNITS = 1024


@dataclass(frozen=True)
class Choice:
    """What one policy does to one block."""

    policy: BlockPolicy
    kept: int  # bytes held between forward and backward (with what is saved between it and the next block)
    seconds: float  # extra step time
    copied: int  # bytes sent to host memory per step
    own: int = 0  # the block's own peak while its backward runs, above what the blocks before it keep (CUDA)
    # with attention offload: its own peak from its attention's backward on, when the reload ahead is issued
    # (None: the reload ahead meets the whole backward)
    own_late: int | None = None

    def need(self, ahead: int) -> int:
        """Bytes above what the blocks before it keep while its backward runs, with ``ahead`` bytes reloaded
        for the blocks backward visits next."""
        return self.own + ahead if self.own_late is None else max(self.own, self.own_late + ahead)


def block_choices(
    block: BlockProfile,
    profile: ModelProfile,
    allowed: tuple[BlockPolicy, ...],
    *,
    grads_after: int = 0,
    saved_after: int = 0,
) -> list[Choice]:
    """One :class:`Choice` per allowed policy (offloads only with a measured copy bandwidth).

    ``grads_after``: gradient bytes of the trainable weights that backward reaches before this block.
    ``saved_after``: bytes the layers between it and the next block save (held by the blocks after it).
    """
    rate = profile.flops_per_second
    ffn_rate = profile.ffn_flops_per_second or rate
    nominal = NOMINAL_FLOPS_PER_SECOND.get(profile.device.split(":")[0], NOMINAL_FLOPS_PER_SECOND["cpu"])
    bandwidth = profile.copy_bytes_per_second
    forward_seconds = (
        block.flops / rate * profile.forward_with_grad
    )  # what a device-to-host copy hides behind
    out = []
    for policy in allowed:
        kept, extra, copied, flops = _effect(policy, block)
        recomputed_ffn = 0
        if policy.recompute == "ffn":  # at the FFN regions' own rate
            flops, recomputed_ffn = 0, flops
        if policy.recompute:
            flops += RECOMPUTE_REGION_SECONDS * nominal
        if copied:
            flops += OFFLOAD_REGION_SECONDS * nominal
        if policy.offloads_attention:
            flops += HOOKED_TENSOR_SECONDS * block.attention_hook_calls * nominal
        seconds = flops / rate + recomputed_ffn / ffn_rate
        if copied:
            if not bandwidth:
                continue
            copy = copied / bandwidth
            seconds += max(0.0, copy - forward_seconds) + max(
                0.0, copy - profile.backward_to_forward * forward_seconds
            )
        own, own_late = 0, None
        if profile.counts_transient:
            # measured with its inputs and everything it saves held; what the policy holds beyond that adds
            extra += block.input_bytes + grads_after
            own = block.backward_peak_bytes + extra
            if policy.offloads_attention and block.attention_backward_peak_bytes:
                # its only parked regions are its attention calls: backward reaches them, and reloads the
                # blocks before, once the FFN's backward is over (memfit.auto.blockpeak, "Attention phase")
                own_late = block.attention_backward_peak_bytes + extra
        out.append(Choice(policy, max(kept, 0) + saved_after, seconds, copied, own, own_late))
    return out


def _effect(policy: BlockPolicy, b: BlockProfile) -> tuple[int, int, int, int]:
    """(kept, extra, copied bytes, recomputed FLOPs) of ``policy`` on block ``b``.

    ``extra``: what the policy holds while the block's backward runs beyond its inputs and what the block
    saves (the isolated run's view): a reload brings back each parked view (what was copied), which can
    exceed the storages it freed, and an FFN region keeps an input the block does not save. A region's input
    that the block does save is the same tensor its recompute saves again: counted once (twice, the Wan
    plans of FFN or block recompute were predicted 0.13 GiB above their measured peaks)."""
    after_ffn = b.saved_bytes - b.ffn_saved_bytes
    views = b.attention_copy_bytes - b.attention_bytes
    return {
        BlockPolicy.KEEP: (b.saved_bytes, 0, 0, 0),
        BlockPolicy.ATTENTION_OFFLOAD: (b.saved_bytes - b.attention_bytes, views, b.attention_copy_bytes, 0),
        BlockPolicy.FFN: (after_ffn + b.ffn_input_bytes, b.ffn_input_unsaved_bytes, 0, b.ffn_flops),
        BlockPolicy.FFN_ATTENTION_OFFLOAD: (
            after_ffn + b.ffn_input_bytes - b.attention_bytes,
            b.ffn_input_unsaved_bytes + views,
            b.attention_copy_bytes,
            b.ffn_flops,
        ),
        BlockPolicy.FFN_OFFLOAD: (
            after_ffn + b.ffn_input_bytes - b.ffn_input_parkable_bytes,
            b.ffn_input_unsaved_bytes,
            b.ffn_input_parkable_bytes,
            b.ffn_flops,
        ),
        BlockPolicy.BLOCK: (b.input_bytes, 0, 0, b.flops),
        BlockPolicy.BLOCK_OFFLOAD: (
            b.input_bytes - b.input_parkable_bytes,
            0,
            b.input_parkable_bytes,
            b.flops,
        ),
    }[policy]


@dataclass(frozen=True)
class Plan:
    """One policy per block, with the predictions that chose it."""

    blocks: tuple[tuple[str, BlockPolicy], ...]  # (block name "path.index", policy), in call order
    budget_bytes: int
    predicted_peak_bytes: int
    predicted_extra_seconds: float
    no_checkpoint_peak_bytes: int
    smallest_peak_bytes: int
    copied_bytes: int
    metric: str  # "peak allocated" (CUDA) or "held activations" (elsewhere)

    @property
    def needed(self) -> bool:
        """False when every block keeps everything (the budget needs no checkpointing)."""
        return any(p is not BlockPolicy.KEEP for _, p in self.blocks)

    def policy(self, name: str) -> BlockPolicy:
        return dict(self.blocks)[name]

    def counts(self) -> dict[str, int]:
        c = Counter(p.value for _, p in self.blocks)
        return {p.value: c[p.value] for p in BlockPolicy if c[p.value]}

    def to_json(self) -> dict[str, Any]:
        return {
            "policies": {name: p.value for name, p in self.blocks},
            "counts": self.counts(),
            "budget_bytes": self.budget_bytes,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "predicted_extra_seconds": self.predicted_extra_seconds,
            "no_checkpoint_peak_bytes": self.no_checkpoint_peak_bytes,
            "smallest_peak_bytes": self.smallest_peak_bytes,
            "copied_bytes_per_step": self.copied_bytes,
            "metric": self.metric,
        }

    def describe(self) -> str:
        """Runs of equal policies, e.g. ``transformer_blocks.0-12: ffn``."""
        lines = [
            f"auto plan ({self.metric}): predicted {format_bytes(self.predicted_peak_bytes)} within "
            f"{format_bytes(self.budget_bytes)} (no checkpointing: {format_bytes(self.no_checkpoint_peak_bytes)}"
            f"), +{self.predicted_extra_seconds * 1e3:.1f} ms/step, {format_bytes(self.copied_bytes)} "
            f"copied/step"
        ]
        run: list[Any] = []
        for name, policy in [*self.blocks, ("", None)]:
            path, _, index = name.rpartition(".")
            if run and (policy is not run[2] or path != run[0]):
                span = run[1] if run[1] == run[3] else f"{run[1]}-{run[3]}"
                lines.append(f"  {run[0]}.{span}: {run[2].value}")
                run = []
            if policy is not None:
                run = [path, index, policy, index] if not run else [run[0], run[1], policy, index]
        return "\n".join(lines)


def plan_policies(
    profile: ModelProfile, budget_bytes: int, *, allowed: Callable[[BlockProfile], tuple[BlockPolicy, ...]]
) -> Plan:
    """The fastest plan (by the cost model) whose predicted peak is within ``budget_bytes``.

    Raises:
        BudgetError: no plan reaches the budget (the message and ``smallest_peak_bytes`` give the smallest).
    """
    grads_after = _gradients_after(profile)
    last = len(profile.blocks) - 1
    options = [
        block_choices(
            b, profile, allowed(b), grads_after=g, saved_after=b.saved_after_bytes if i < last else 0
        )
        for i, (b, g) in enumerate(zip(profile.blocks, grads_after, strict=True))
    ]
    if options and profile.blocks[-1].attention_calls < 2:
        # the step's last two regions keep their tensors on the device: before a last block whose attention
        # is one region, the block before it is never reloaded, its tensors stay through the whole backward
        options[-1] = [dataclasses.replace(c, own_late=None) for c in options[-1]]
    head = profile.blocks[-1].saved_after_bytes if profile.blocks else 0  # held throughout (see "Head")
    base = profile.static_bytes + profile.outside_bytes + head
    metric = "peak allocated" if profile.static_bytes or profile.workspace_bytes else "held activations"
    depth = PREFETCH_DEPTH if profile.counts_transient else 0

    def peak(picks: list[Choice]) -> int:
        prefix = worst = 0
        for b, c in enumerate(picks):
            if profile.counts_transient:
                worst = max(
                    worst, prefix + c.need(reloaded_ahead([p.copied for p in reversed(picks[:b])], depth))
                )
            prefix += c.kept
        return base + max(worst, prefix + profile.workspace_bytes)

    keep_all = [next(c for c in opts if c.policy is BlockPolicy.KEEP) for opts in options]
    no_checkpoint = peak(keep_all)
    unit = max(1, -(-sum(b.saved_bytes for b in profile.blocks) // _UNITS))
    problem = search.Problem(options, unit, depth, own_counts=profile.counts_transient)
    # the least peak any plan reaches: exact under the model up to the units, recomputed in bytes
    floor_picks = search.smallest(
        problem, sum(max(problem.units(c) for c in opts) for opts in options), profile.workspace_bytes
    )
    smallest = min(peak(floor_picks), no_checkpoint)

    def make(picks: list[Choice]) -> Plan:
        return Plan(
            blocks=tuple((b.name, c.policy) for b, c in zip(profile.blocks, picks, strict=True)),
            budget_bytes=budget_bytes,
            predicted_peak_bytes=peak(picks),
            predicted_extra_seconds=sum(c.seconds for c in picks),
            no_checkpoint_peak_bytes=no_checkpoint,
            smallest_peak_bytes=smallest,
            copied_bytes=sum(c.copied for c in picks),
            metric=metric,
        )

    if no_checkpoint <= budget_bytes:
        return make(keep_all)
    if smallest > budget_bytes:
        raise BudgetError(
            f"memory budget {format_bytes(budget_bytes)} is below what any plan reaches: the smallest predicted "
            f"{metric} is {format_bytes(smallest)} (no checkpointing: {format_bytes(no_checkpoint)}). Raise "
            f"gradient_checkpointing_memory_budget to at least that, or shrink the step (batch, resolution).",
            smallest_peak_bytes=smallest,
        )
    room = budget_bytes - base  # for kept bytes, and each block's own peak on top of those before it
    picks = search.cheapest(problem, (room - profile.workspace_bytes) // unit, room)
    if picks is None or peak(picks) > budget_bytes:  # only the units' rounding stood in the way
        picks = floor_picks  # the smallest plan, which fits exactly
    return make(picks)


def reloaded_ahead(copied: list[int], depth: int) -> int:
    """Bytes the copy engine reloads ahead while a block's backward runs, given what the blocks before it copy
    (nearest first): the next one that copies, and further ones while those already reloaded are smaller, at
    most ``depth`` (the rule of :meth:`memfit.offload.session.OffloadSession.needed`, block by block)."""
    ahead = 0
    for taken, size in enumerate(c for c in copied if c):
        if taken == depth or (taken and ahead >= size):
            break
        ahead += size
    return ahead


def _gradients_after(profile: ModelProfile) -> list[int]:
    """Per block: gradient bytes already allocated when backward reaches it (the trainable weights outside
    the blocks and in every later block; a block's own weight gradients are part of its measured peak)."""
    out, pending = [], profile.outside_trainable_bytes
    for b in reversed(profile.blocks):
        out.append(pending)
        pending += b.trainable_bytes
    return out[::-1]
