"""The peer baselines: each one changes nothing a step computes, really checkpoints (counted, and fewer bytes saved
for backward), and leaves the model as it found it."""

from __future__ import annotations

import contextlib
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import memfit
from memfit.engine import frame
from memfit_benchmarks import peers
from memfit_benchmarks.modes import Peer
from memfit_benchmarks.synthetic import SYNTHETIC, build, inputs
from memfit_benchmarks.training import TrainingConfig, prepare


def _synthetic():
    model = build(dim=32, depth=3, dtype=torch.float32, device="cpu")
    batch = inputs(model, tokens=16, generator=torch.Generator().manual_seed(0))
    prepare(model, batch, TrainingConfig.LORA_ALL, SYNTHETIC, dtype=torch.float32)
    return model, batch, SYNTHETIC


def _flux():
    pytest.importorskip("memfit_flux")
    adapter = memfit.get_adapter("flux")
    preset = adapter.presets["tiny"]
    model = preset.build(dtype=torch.float32, device="cpu")
    batch = preset.inputs(model, tokens=64, batch=1, generator=torch.Generator().manual_seed(0))
    prepare(model, batch, TrainingConfig.LORA_ALL, adapter, dtype=torch.float32)
    return model, batch, adapter


def _family(name, config=TrainingConfig.LORA_ALL):
    pytest.importorskip(f"memfit_{name.replace('-', '_')}")
    adapter = memfit.get_adapter(name)
    preset = adapter.presets["tiny"]
    model = preset.build(dtype=torch.float32, device="cpu")
    batch = preset.inputs(
        model, tokens=preset.default_tokens, batch=1, generator=torch.Generator().manual_seed(0)
    )
    prepare(model, batch, config, adapter, dtype=torch.float32)
    return model, batch, adapter


def _instance_state(model):
    """Every module's instance attributes (by identity) and the model's config: what a peer must leave as found."""
    config = getattr(model, "config", None)
    return (
        {name: {k: id(v) for k, v in m.__dict__.items()} for name, m in model.named_modules()},
        dict(config) if isinstance(config, dict) else None,
        dict(vars(config)) if config is not None and hasattr(config, "__dict__") else None,
    )


def _step(model, batch, adapter, context=None):
    """Output, trainable gradients and saved-for-backward bytes of one forward+backward."""
    model.zero_grad(set_to_none=True)
    with (
        memfit.SavedBytesMeter(exclude=list(model.parameters())) as meter,
        (context or contextlib.nullcontext)(),
    ):
        out = model(**batch)
        loss = adapter.loss(out)
    loss.backward()
    out = out.sample if hasattr(out, "sample") else out
    out = out[0] if isinstance(out, (tuple, list)) else out
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), grads, meter.total_bytes


def _forward_attributes(model):
    return [name for name, m in model.named_modules() if "forward" in m.__dict__]


@pytest.mark.parametrize(
    ("build_model", "peer", "calls"),
    [
        (_synthetic, Peer.CHECKPOINT_BLOCK, 3),
        (_synthetic, Peer.CHECKPOINT_FFN, 3),
        (_flux, Peer.CHECKPOINT_BLOCK, 7),  # 3 double + 4 single blocks
        (
            _flux,
            Peer.CHECKPOINT_FFN,
            10,
        ),  # ff and ff_context per double block, proj_mlp → act_mlp per single one
    ],
)
def test_checkpoint_peers_change_no_gradient_and_checkpoint_every_region(build_model, peer, calls):
    torch.manual_seed(0)
    model, batch, adapter = build_model()
    out, grads, saved = _step(model, batch, adapter)
    installation = peers.install(peer, model, adapter)
    try:
        with torch.random.fork_rng():
            peer_out, peer_grads, peer_saved = _step(model, batch, adapter, installation.step_context)
        assert installation.checkpointed_calls() == calls
    finally:
        installation.remove()
    assert torch.equal(out, peer_out)
    assert grads.keys() == peer_grads.keys() and grads
    for name, grad in grads.items():
        assert torch.equal(grad, peer_grads[name]), name
    assert peer_saved < saved  # the regions' activations were not kept for backward
    assert _forward_attributes(model) == []  # every wrapper is gone
    again, _, saved_again = _step(model, batch, adapter)
    assert torch.equal(again, out) and saved_again == saved


def test_diffusers_checkpointing_changes_no_gradient_and_is_undone():
    model, batch, adapter = _flux()
    flags = {
        n: (m.gradient_checkpointing, "_gradient_checkpointing_func" in m.__dict__)
        for n, m in model.named_modules()
        if hasattr(m, "gradient_checkpointing")
    }
    out, grads, saved = _step(model, batch, adapter)
    installation = peers.install(Peer.DIFFUSERS, model, adapter)
    try:
        assert model.is_gradient_checkpointing and installation.checkpointed_calls() == 0
        peer_out, peer_grads, peer_saved = _step(model, batch, adapter)
        # the model's own checkpoint function ran once per block in the forward (its recompute calls the block)
        assert installation.checkpointed_calls() == len(list(adapter.iter_blocks(model)))
    finally:
        installation.remove()
    assert torch.equal(out, peer_out) and all(torch.equal(g, peer_grads[n]) for n, g in grads.items())
    assert peer_saved < saved
    assert flags == {
        n: (m.gradient_checkpointing, "_gradient_checkpointing_func" in m.__dict__)
        for n, m in model.named_modules()
        if hasattr(m, "gradient_checkpointing")
    }


@pytest.mark.parametrize("name", ["chroma", "flux", "krea2", "ltxvideo2", "mageflow", "wan", "z-image"])
def test_the_ffn_peer_and_diffusers_checkpointing_on_every_family(name):
    """The FFN peer checkpoints every declared FFN region once per step and changes nothing computed; diffusers'
    checkpointing, where it runs, leaves the model exactly as it found it (the model's own switches included), so
    the rows measured after it are not checkpointed by the model too."""
    model, batch, adapter = _family(name)
    out, grads, saved = _step(model, batch, adapter)

    def ffn_peer():
        installation = peers.install(Peer.CHECKPOINT_FFN, model, adapter)
        try:
            with torch.random.fork_rng():
                stepped = _step(model, batch, adapter, installation.step_context)
            return stepped, installation.checkpointed_calls(), len(installation.chains)
        finally:
            installation.remove()

    (peer_out, peer_grads, peer_saved), calls, chains = ffn_peer()
    assert calls == chains > 0
    assert torch.equal(out, peer_out) and grads.keys() == peer_grads.keys() and grads
    for grad_name, grad in grads.items():
        assert torch.equal(grad, peer_grads[grad_name]), grad_name
    assert peer_saved < saved
    if peers.unsupported(Peer.DIFFUSERS, model, adapter) is not None:
        return
    before = _instance_state(model)
    installation = peers.install(Peer.DIFFUSERS, model, adapter)
    try:
        _, _, checkpointed_saved = _step(model, batch, adapter)
        checkpointed = installation.checkpointed_calls()
    finally:
        installation.remove()
    assert checkpointed_saved < saved
    # the blocks the model routes through diffusers' checkpoint function: every declared one, but Krea 2's text
    # fusion; Mage-Flow checkpoints through a branch of its own, which is not counted
    declared = list(adapter.iter_blocks(model))
    outside = [b for path, _, b in declared if path.startswith("text_fusion.")]
    assert bool(outside) == (name == "krea2")
    if name == "mageflow":
        assert checkpointed is None
    else:
        assert checkpointed == len(declared) - len(outside) > 0
    assert _instance_state(model) == before
    assert ffn_peer()[1] == calls  # not nested inside the model's own block checkpoints


class _ComputeOps(TorchDispatchMode):
    """Counts the ops that run kernels (views and detaches left out: they move no data)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func.overloadpacket is not torch.ops.aten.detach:
            self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("config", [TrainingConfig.LORA_ATTENTION, TrainingConfig.LORA_ALL], ids=str)
@pytest.mark.parametrize("name", ["chroma", "flux", "krea2", "ltxvideo2", "mageflow", "wan", "z-image"])
def test_memfit_torch_runs_no_op_that_torch_checkpoint_per_block_does_not(name, config, monkeypatch):
    """Op for op, a step of memfit ``torch`` runs no kernel more often than ``torch.utils.checkpoint``'s early stop
    over the same blocks, at the sizes where memfit cuts a block's replay after its last needed tensor (its output
    as large as at 4096 tokens: lowered here to the tiny preset's). The two differ only in host work."""
    monkeypatch.setattr(frame, "CUT_TAIL_OUTPUT", 0)
    model, batch, adapter = _family(name, config)
    out, grads, _ = _step(
        model, batch, adapter
    )  # also fills the models' caches (rotary tables) before counting

    def counted(context):
        with _ComputeOps() as ops:
            stepped = _step(model, batch, adapter, context)
        return ops.counts, stepped

    handle = memfit.apply(model, {"gradient_checkpointing": True}, adapter=adapter)
    with handle:
        ours, (our_out, our_grads, _) = counted(None)
        assert handle.stats()["calls_cut_early_stop"] > 0
    assert torch.equal(out, our_out) and our_grads.keys() == grads.keys()
    assert all(torch.equal(g, grads[n]) for n, g in our_grads.items())
    installation = peers.install(Peer.CHECKPOINT_BLOCK, model, adapter)
    try:
        theirs, _ = counted(installation.step_context)
    finally:
        installation.remove()
    more = {op: (n, theirs[op]) for op, n in ours.items() if n > theirs[op]}
    assert not more, f"memfit runs these ops more often (memfit, peer): {more}"


def test_save_on_cpu_changes_no_gradient():
    model, batch, adapter = _synthetic()
    out, grads, _ = _step(model, batch, adapter)
    installation = peers.install(Peer.SAVE_ON_CPU, model, adapter)
    peer_out, peer_grads, _ = _step(model, batch, adapter, installation.step_context)
    installation.remove()
    assert torch.equal(out, peer_out) and all(torch.equal(g, peer_grads[n]) for n, g in grads.items())


def test_a_peer_that_does_not_apply_says_why():
    model, _, adapter = _synthetic()
    reason = peers.unsupported(Peer.DIFFUSERS, model, adapter)
    assert reason == "the model has no diffusers gradient checkpointing"
    with pytest.raises(ValueError, match="peer 'diffusers-ckpt' cannot run on SynthStack: the model has no"):
        peers.install(Peer.DIFFUSERS, model, adapter)
    assert peers.unsupported(Peer.CHECKPOINT_FFN, model, None) == "needs the family's declared blocks"


def test_a_chain_called_otherwise_than_declared_is_an_error():
    first, second = torch.nn.Linear(4, 4), torch.nn.GELU()
    chain = peers.CheckpointedChain([first, second])
    x = torch.randn(2, 4, requires_grad=True)
    try:
        y = first(x)
        assert second(y) is y  # the chain's output passes the later module unchanged
        first(x)
        with pytest.raises(RuntimeError, match="was not called with the previous call's output alone"):
            second(x + 1)
    finally:
        chain.remove()
    assert "forward" not in first.__dict__ and "forward" not in second.__dict__


def test_diffusers_checkpointing_is_no_peer_where_its_branch_calls_blocks_differently():
    pytest.importorskip("memfit_chroma")
    adapter = memfit.get_adapter("chroma")  # its checkpointing branch drops the single blocks' attention_mask
    model = adapter.presets["tiny"].build(dtype=torch.float32, device="cpu")
    assert peers.unsupported(Peer.DIFFUSERS, model, adapter) == (
        "the family's checkpointing branch does not call its blocks as the normal forward does"
    )


def test_a_failing_peer_is_a_row_and_a_failing_memfit_mode_is_raised(monkeypatch):
    from memfit_benchmarks import runner
    from memfit_benchmarks.modes import Mode
    from memfit_benchmarks.report import row_table

    model, batch, adapter = _synthetic()

    def broken(*args, **kwargs):
        raise RuntimeError("cannot wrap this block")

    monkeypatch.setattr(runner.peers, "install", broken)
    row = runner.measure_mode(
        model, batch, adapter.loss, Mode("ckpt-block", None, Peer.CHECKPOINT_BLOCK), adapter=adapter
    )
    assert row["failed"] == "RuntimeError: cannot wrap this block" and not row["oom"] and "step_s" not in row
    torch_row = runner.measure_mode(
        model,
        batch,
        adapter.loss,
        Mode("torch", {"gradient_checkpointing": True}),
        adapter=adapter,
        warmup=0,
        steps=1,
    )
    rows = [torch_row, row]
    runner.add_ratios(rows)
    assert torch_row["vs_peer"] == "ckpt-block" and torch_row["peer_failed"].startswith("RuntimeError")
    assert "| ckpt-block | failed (RuntimeError: cannot wrap this block) |" in "\n".join(row_table(rows))
    monkeypatch.setattr(runner.memfit, "apply", broken)
    with pytest.raises(RuntimeError, match="cannot wrap this block"):
        runner.measure_mode(
            model, batch, adapter.loss, Mode("torch", {"gradient_checkpointing": True}), adapter=adapter
        )
