"""The cost model: what one policy does to one block — bytes kept, copied, extra seconds (see
``docs/cost-model.md`` for where each constant comes from)."""

from __future__ import annotations

from dataclasses import dataclass

from memfit.auto.profile import BlockProfile, ModelProfile
from memfit.plan import BlockPolicy

# Fixed host costs, from H200 measurements (docs/cost-model.md):
RECOMPUTE_REGION_SECONDS = 50e-6  # per recomputed region: hooks, frame bookkeeping, replay
OFFLOAD_REGION_SECONDS = 50e-6  # per parked region: events, pool and stream bookkeeping
HOOKED_TENSOR_SECONDS = 10e-6  # per tensor saved in an offloaded attention call or a parked block: its hooks
NOMINAL_FLOPS_PER_SECOND = {"cuda": 4e14, "cpu": 5e10}  # converts the fixed costs above to FLOPs


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
    # the part of ``seconds`` that is its device-to-host copy not hidden behind its own forward: where the search
    # runs the forward's copies as one queue (memfit.auto.search, "Queue"), it charges the queue's waits instead
    forward_exposed: float = 0.0
    # seconds its backward recomputes before the block before it is due, while that block's reload is in flight
    # (memfit.auto.search, "Reload credit"); 0 where it recomputes nothing or its attention's reload starts late
    recompute_window: float = 0.0

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
    reload_cover: float | None = None,
) -> list[Choice]:
    """One :class:`Choice` per allowed policy (offloads only with a measured copy bandwidth).

    ``grads_after``: gradient bytes of the trainable weights that backward reaches before this block.
    ``saved_after``: bytes the layers between it and the next block save (held by the blocks after it).
    ``reload_cover``: seconds of backward compute its reloads may hide behind (None: its own backward; where
    weight uploads share the link, what they leave: :attr:`memfit.auto.streaming.StreamedSet.reload_cover`).
    """
    rate = profile.flops_per_second
    ffn_rate = profile.ffn_flops_per_second or rate
    nominal = NOMINAL_FLOPS_PER_SECOND.get(profile.device.split(":")[0], NOMINAL_FLOPS_PER_SECOND["cpu"])
    bandwidth = profile.copy_bytes_per_second
    forward_seconds = forward_with_grad_seconds(block, profile)  # what a device-to-host copy hides behind
    if reload_cover is None:  # what the host-to-device reload hides behind
        reload_cover = own_reload_cover(block, profile)
    out = []
    for policy in allowed:
        if policy.parks_block and not block.park_copy_bytes:
            continue  # nothing worth a copy: parking would be keeping, with hooks
        kept, extra, copied, flops = _effect(policy, block)
        recomputed_ffn = 0
        if policy.recompute == "ffn":  # at the FFN regions' own rate
            flops, recomputed_ffn = 0, flops
        # the reload of the block before it is issued as this backward starts, before its recompute, unless an
        # offloaded attention call is its first region of the timeline (reached after its FFN's backward)
        window = 0.0
        if policy.recompute and not policy.offloads_attention:
            window = recompute_seconds(policy, block, profile)
        if policy.recompute:
            flops += RECOMPUTE_REGION_SECONDS * nominal
        if copied:
            flops += OFFLOAD_REGION_SECONDS * nominal
        if policy.offloads_attention:
            flops += HOOKED_TENSOR_SECONDS * block.attention_hook_calls * nominal
        if policy.parks_block:
            flops += HOOKED_TENSOR_SECONDS * block.park_hook_calls * nominal
        seconds = flops / rate + recomputed_ffn / ffn_rate
        exposed = 0.0
        if copied:
            if not bandwidth:
                continue
            copy = copied / bandwidth
            exposed = max(0.0, copy - forward_seconds)
            seconds += exposed + max(0.0, copy - reload_cover)
        own, own_late = 0, None
        if profile.counts_transient:
            # measured with its inputs and everything it saves held; what the policy holds beyond that adds
            extra += block.input_bytes + grads_after
            own = block.backward_peak_bytes + extra
            if policy.offloads_attention and block.attention_backward_peak_bytes:
                # its only parked regions are its attention calls: backward reaches them, and reloads the
                # blocks before, once the FFN's backward is over (memfit.auto.blockpeak, "Attention phase")
                own_late = block.attention_backward_peak_bytes + extra
        out.append(
            Choice(policy, max(kept, 0) + saved_after, seconds, copied, own, own_late, exposed, window)
        )
    return out


def own_reload_cover(block: BlockProfile, profile: ModelProfile) -> float:
    """Seconds of backward compute a reload of ``block``'s copies hides behind where no weight upload shares the
    link: its own backward's, standing for the backward of the block before it in backward order."""
    return profile.backward_to_forward * forward_with_grad_seconds(block, profile)


def recompute_seconds(policy: BlockPolicy, block: BlockProfile, profile: ModelProfile) -> float:
    """How long ``policy``'s recompute of ``block`` runs in backward: the whole forward at the blocks' rate, or
    its FFN regions at theirs (0: nothing recomputed)."""
    flops = _effect(policy, block)[3]
    if policy.recompute == "ffn":
        return flops / (profile.ffn_flops_per_second or profile.flops_per_second)
    return flops / profile.flops_per_second


def forward_with_grad_seconds(block: BlockProfile, profile: ModelProfile) -> float:
    """How long ``block``'s forward runs with gradients: the time its device-to-host copies hide behind."""
    return block.flops / profile.flops_per_second * profile.forward_with_grad


def _effect(policy: BlockPolicy, b: BlockProfile) -> tuple[int, int, int, int]:
    """(kept, extra, copied bytes, recomputed FLOPs) of ``policy`` on block ``b``.

    ``extra``: what the policy holds while the block's backward runs beyond its inputs and what the block
    saves (the isolated run's view): a reload brings back each parked view (what was copied), which can
    exceed the storages it freed, and an FFN region keeps an input the block does not save. A region's input
    that the block does save is the same tensor its recompute saves again: counted once (docs/cost-model.md)."""
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
        # everything parked: a reload brings back each copied view, which can exceed the storages freed
        BlockPolicy.PARK: (
            b.saved_bytes - b.park_bytes,
            max(0, b.park_copy_bytes - b.park_bytes),
            b.park_copy_bytes,
            0,
        ),
    }[policy]
