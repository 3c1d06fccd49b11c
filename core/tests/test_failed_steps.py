"""A step that fails (out of memory in the forward or the backward, a ``BudgetError`` from ``auto``'s planning, an
interrupt), or a forward with gradients whose result is dropped, leaves no activation alive once the trainer has
dropped what it held and memfit is removed — and the next ``memfit.apply`` on the model computes exactly.

What could keep activations (docs/architecture.md, "What autograd keeps"): an object a saved-tensor hook returns is
owned by the autograd node, where the garbage collector cannot see it; if it holds a tensor whose history leads
back to that node (attention saves its own output), the node keeps itself — and every activation before it —
alive for good, unless backward runs it. The checks here are weak references to every module's outputs: a
tensor's Python object lives as long as anything, C++ included, holds the tensor.

Copies run through the synchronous engine and through the CUDA engine's logic over recording streams whose
events never complete by themselves (copies still in flight when the step fails).
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch
from torch.utils._pytree import tree_flatten

import memfit
from memfit.engine import state
from memfit_conformance.base import cpu_copy_engine
from memfit_conformance.streams import order_checking_copy_engine

from helpers import FAILED_STEP_CONFIGS, ON, assert_same_family_step, auto_mix, family_step, force_auto_plan

memfit_flux = pytest.importorskip("memfit_flux")
ADAPTER = memfit_flux.ADAPTER
TINY = ADAPTER.presets["tiny"]

CONFIGS = FAILED_STEP_CONFIGS
ENGINES = {"sync": cpu_copy_engine, "in-flight": lambda: order_checking_copy_engine(landed=False)}


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return TINY.build(dtype=torch.float32, device="cpu")


@pytest.fixture(scope="module")
def batch(model):
    return TINY.inputs(model, tokens=64, generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def reference(model, batch):
    return step(model, batch)


@pytest.fixture
def auto_mix_plan(monkeypatch):
    """``auto`` plans :func:`helpers.auto_mix` (off CUDA its planner would not copy at this size)."""
    force_auto_plan(monkeypatch, auto_mix)


def step(model, batch):
    return family_step(model, batch, ADAPTER)


_applied: list[memfit.MemfitHandle] = []


@pytest.fixture(autouse=True)
def removes_what_it_applied():
    """A test that fails half way does not leave memfit on the module's model for the next one."""
    yield
    while _applied:
        _applied.pop().remove()


def apply(model, name, engine="sync", **overrides):
    handle = memfit.apply(
        model,
        {**CONFIGS[name], **overrides},
        adapter=ADAPTER,
        copy_engine=ENGINES[engine](),
        min_offload_bytes=0,
    )
    _applied.append(handle)
    return handle


class Activations:
    """Weak references to the outputs of every module call while it is open (a global forward hook)."""

    def __init__(self) -> None:
        self.refs: list[tuple[str, weakref.ref]] = []

    def __enter__(self) -> Activations:
        self._hook = torch.nn.modules.module.register_module_forward_hook(self._note)
        return self

    def __exit__(self, *exc: object) -> None:
        self._hook.remove()

    def _note(self, module, args, output) -> None:
        for t in tree_flatten(output)[0]:
            if isinstance(t, torch.Tensor):
                self.refs.append((type(module).__name__, weakref.ref(t)))

    def alive(self) -> list[str]:
        """The modules whose outputs are still alive (after :func:`settle`)."""
        settle()
        return [name for name, ref in self.refs if ref() is not None]


def settle() -> None:
    """Collect garbage. A backward that raised leaves the tasks it had not run yet in autograd's ready queue for
    this thread, holding their nodes, until the next backward on the thread (torch's engine does that with or
    without memfit): a tiny backward runs them out first."""
    torch.nn.Linear(1, 1)(torch.ones(1, 1)).sum().backward()
    gc.collect()


def raising(
    module: torch.nn.Module, *, when: Callable[[], bool] = lambda: True, error=torch.OutOfMemoryError
):
    """A forward hook on ``module`` that raises ``error`` at its first call for which ``when()`` holds."""
    fired = []

    def hook(m, args, output):
        if not fired and when():
            fired.append(1)
            raise error("injected")

    return module.register_forward_hook(hook)


@contextmanager
def failing(model, path: str, **kw) -> Iterator[None]:
    handle = raising(model.get_submodule(path), **kw)
    try:
        yield
    finally:
        handle.remove()


def assert_thread_clean() -> None:
    """No region call left open, no saved-tensor hooks left on this thread's autograd state."""
    assert not state.in_region_call()
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


def assert_next_apply_exact(model, batch, reference, name) -> None:
    with apply(model, name):
        got = step(model, batch)
    assert_same_family_step(got, reference)


def fail_step(model, batch) -> type[BaseException]:
    """One training step that is expected to raise; returns what it raised (the trainer's loop goes on)."""
    model.zero_grad(set_to_none=True)
    try:
        loss = ADAPTER.loss(model(**batch))
        loss.backward()
    except (torch.OutOfMemoryError, memfit.BudgetError, KeyboardInterrupt) as exc:
        return type(exc)
    raise AssertionError("the step did not fail")


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.usefixtures("auto_mix_plan")
def test_a_forward_with_gradients_never_backwarded_frees_its_activations(model, batch, name):
    """Validation with gradients on, or a result dropped: attention saves its own output, so what memfit kept
    for it must not hold that output with its history (it did: the whole graph stayed alive)."""
    with apply(model, name) as handle:
        with Activations() as seen:
            ADAPTER.loss(model(**batch))
        assert seen.refs and seen.alive() == []
        assert handle.stats()["host_buffers_in_use"] == 0


# where the forward runs out of memory: inside an FFN region, inside an attention call (offloaded or inside a
# recomputed block), between regions, and after the last block (the step's last regions still wait to be parked)
FORWARD_FAILURES = [
    "transformer_blocks.0.ff.net.2",
    "transformer_blocks.1.attn.to_out.0",
    "single_transformer_blocks.1.proj_mlp",
    "single_transformer_blocks.2.attn.to_k",
    "transformer_blocks.2.norm1",
    "proj_out",
]


@pytest.mark.parametrize("engine", list(ENGINES))
@pytest.mark.parametrize("where", FORWARD_FAILURES)
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.usefixtures("auto_mix_plan")
def test_out_of_memory_in_the_forward_frees_every_activation(model, batch, reference, name, where, engine):
    handle = apply(model, name, engine)
    step(model, batch)  # a first step (auto plans)
    with Activations() as seen, failing(model, where):
        assert fail_step(model, batch) is torch.OutOfMemoryError
    assert_thread_clean()
    assert seen.alive() == []
    assert handle.stats()["host_buffers_in_use"] == 0  # the failed step's host buffers went back to the pool
    handle.remove()
    assert_next_apply_exact(model, batch, reference, name)


# (config, a module its plan recomputes)
RECOMPUTE_FAILURES = [
    (name, where)
    for name in ("unsloth-ffn+attention", "unsloth-i2", "auto")
    for where in ("transformer_blocks.1.ff.net.2", "single_transformer_blocks.1.proj_mlp")
] + [("unsloth-i2", "single_transformer_blocks.3.norm"), ("auto", "single_transformer_blocks.3.norm")]


@pytest.mark.parametrize(("name", "where"), RECOMPUTE_FAILURES)
@pytest.mark.usefixtures("auto_mix_plan")
def test_out_of_memory_in_a_recompute_frees_every_activation(model, batch, reference, name, where):
    handle = apply(model, name, "in-flight")
    step(model, batch)
    with Activations() as seen, failing(model, where, when=state.recomputing):
        assert fail_step(model, batch) is torch.OutOfMemoryError
    assert_thread_clean()
    assert seen.alive() == []
    handle.remove()
    assert_next_apply_exact(model, batch, reference, name)


def raising_in_backward(module: torch.nn.Module):
    """A forward hook on ``module`` whose output's gradient raises out of memory when backward reaches it."""

    def fail(grad):
        raise torch.OutOfMemoryError("injected")

    def hook(m, args, output):
        output.register_hook(fail)

    return module.register_forward_hook(hook)


def test_a_failed_backward_frees_what_reload_ahead_held(model, batch, reference):
    """Reload ahead holds a parked tensor that is still alive elsewhere instead of copying it back. Held with its
    history, it kept the graph of its own attention call (it is computed inside it) alive when backward failed
    before fetching it. Here each attention's query is alive elsewhere (in this list; in a trainer, any other
    holder) until the failed step is over."""
    held: list[torch.Tensor] = []
    hooks = [
        block.attn.norm_q.register_forward_pre_hook(lambda m, args: held.append(args[0]))
        for _, _, block in ADAPTER.iter_blocks(model)
    ]
    hooks.append(raising_in_backward(model.get_submodule("transformer_blocks.0.ff.net.2")))
    try:
        with apply(model, "attention-offload"), Activations() as seen:
            assert fail_step(model, batch) is torch.OutOfMemoryError
            held.clear()
            assert seen.alive() == []
    finally:
        for h in hooks:
            h.remove()
    assert_next_apply_exact(model, batch, reference, "attention-offload")


def test_an_entry_made_between_two_calls_of_a_chunk_is_freed_after_a_failed_forward():
    """Code between two blocks of one chunk (a controlnet residual) makes the next block's input an entry of the
    chunk's region, computed from the region's own outputs: waiting to be parked, it must not be held with that
    history (the region would keep itself alive through it)."""
    from toy import TOY, build

    toy = build()
    x = torch.randn(2, 8, 16, requires_grad=True)
    residuals = [torch.randn(2, 8, 16) for _ in toy.blocks]
    config = {**ON, "gradient_checkpointing_backend": "unsloth", "gradient_checkpointing_interval": 3}
    with memfit.apply(toy, config, adapter=TOY, copy_engine=cpu_copy_engine(), min_offload_bytes=0) as handle:
        with Activations() as seen, failing(toy, "blocks.2.ff_out"), pytest.raises(torch.OutOfMemoryError):
            toy(x, residuals)
        assert seen.alive() == []
        assert handle.stats()["host_buffers_in_use"] == 0


@pytest.mark.parametrize(
    "where", ["transformer_blocks.1.ff.net.2", "single_transformer_blocks.2.attn.to_k", "proj_out"]
)
def test_remove_after_an_interrupted_forward_frees_its_step(model, batch, reference, where):
    """``KeyboardInterrupt`` skips the hooks that end a forward: ``remove()`` ends its step (the tensors it had not
    parked yet, its host buffers), even while the trainer still holds the handle."""
    handle = apply(model, "unsloth-ffn+attention")
    with Activations() as seen, failing(model, where, error=KeyboardInterrupt):
        assert fail_step(model, batch) is KeyboardInterrupt
    handle.remove()
    assert seen.alive() == []
    assert handle.session.copy.pool.stats().buffers_in_use == 0
    assert_thread_clean()
    assert_next_apply_exact(model, batch, reference, "unsloth-ffn+attention")


def test_a_model_dropped_with_memfit_applied_after_an_interrupted_forward_is_freed():
    """Without ``remove()``: the model, its handle and the interrupted step's activations are garbage together
    (a region's finalizer held the session, whose step still listed the region: neither could die)."""
    torch.manual_seed(0)
    flux = TINY.build(dtype=torch.float32, device="cpu")
    inputs = TINY.inputs(flux, tokens=64, generator=torch.Generator().manual_seed(1))
    handle = memfit.apply(
        flux, CONFIGS["attention-offload"], copy_engine=cpu_copy_engine(), min_offload_bytes=0
    )
    with Activations() as seen, failing(flux, "proj_out", error=KeyboardInterrupt):
        assert fail_step(flux, inputs) is KeyboardInterrupt
    state.undo_open_calls()  # (what the next forward or remove() would do first: none comes)
    dropped = weakref.ref(flux)
    del flux, handle, inputs
    assert seen.alive() == []
    assert dropped() is None


@pytest.mark.parametrize("engine", list(ENGINES))
def test_a_batch_of_copies_that_fails_gives_its_host_buffers_back(engine, monkeypatch):
    copies = ENGINES[engine]()
    if engine == "in-flight":
        copies.coalesce_max_bytes = 0  # tensor by tensor: one host buffer each, as large batches on a GPU
    acquire = copies.pool.acquire
    calls = []

    def out_of_memory_at_the_third(nbytes):
        calls.append(nbytes)
        if len(calls) == 3:
            raise torch.OutOfMemoryError("injected")
        return acquire(nbytes)

    monkeypatch.setattr(copies.pool, "acquire", out_of_memory_at_the_third)
    kept = copies.offload_many([torch.randn(8)])  # an earlier batch's buffer stays in use
    with pytest.raises(torch.OutOfMemoryError):
        copies.offload_many([torch.randn(8) for _ in range(4)])
    assert copies.pool.stats().buffers_in_use == 1
    copies.release(kept[0])
    assert copies.pool.stats().buffers_in_use == 0


def test_a_budget_error_from_planning_leaves_nothing_behind(model, batch, reference):
    handle = apply(model, "auto", gradient_checkpointing_memory_budget=1000)
    with Activations() as seen:
        assert fail_step(model, batch) is memfit.BudgetError
        assert fail_step(model, batch) is memfit.BudgetError  # a trainer that catches it and goes on
    assert_thread_clean()
    assert seen.alive() == []
    handle.remove()
    assert_next_apply_exact(model, batch, reference, "unsloth-i2")


@pytest.mark.usefixtures("auto_mix_plan")
def test_out_of_memory_in_autos_profiling_forward_leaves_nothing_behind(model, batch, reference):
    """The first forward of an input shape profiles the model inside the forward's pre-hook, with every weight on
    the device: out of memory there is a BudgetError before any step (what the process must hold is named)."""
    handle = apply(model, "auto")
    with (
        Activations() as seen,
        failing(model, "single_transformer_blocks.0.proj_mlp"),
        pytest.raises(memfit.BudgetError, match="profiling forward, which runs the model once"),
    ):
        model(**batch)
    assert handle.plan is None  # raised while planning
    assert_thread_clean()
    assert seen.alive() == []
    loss, grads = step(model, batch)  # the next step plans again and runs the plan
    assert handle.plan is not None and torch.equal(loss, reference[0])
    handle.remove()
    assert_next_apply_exact(model, batch, reference, "auto")
