"""``memfit fit`` on a card that cannot hold the weights, on CPU: when it builds on the host, how a rung places
the model, and what a placement that does not fit reads as. The whole run (a model larger than a limited
process) is ``test_gpu_weights.py``'s."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("memfit_flux")

import memfit  # noqa: E402
from memfit.auto import budget_planner  # noqa: E402
from memfit.job import HOST_START_SHARE, FitJob, _moved, _weights_exceed, build_workload  # noqa: E402
from memfit.measure import FailureKind, measure_guarded, measure_step  # noqa: E402

JOB = FitJob(family="flux", tokens=16)


def test_the_weights_start_on_the_host_where_they_would_fill_the_card(monkeypatch):
    weights = sum(p.numel() * p.element_size() for p in build_workload(JOB).model.parameters())
    for capacity, on_host in (
        (int(weights / HOST_START_SHARE) + 64, False),
        (int(weights / HOST_START_SHARE) - 64, True),
    ):
        monkeypatch.setattr(budget_planner, "device_capacity", lambda device, c=capacity: c)
        assert _weights_exceed(JOB, torch.float32, torch.device("cuda")) is on_host
    monkeypatch.setattr(budget_planner, "device_capacity", lambda device: None)  # not CUDA: nothing to exceed
    assert not _weights_exceed(JOB, torch.float32, torch.device("cuda"))


def test_inputs_moved_to_the_card_stay_leaves_that_want_gradients():
    x = torch.randn(2, 3, requires_grad=True)
    moved = _moved({"hidden_states": x, "ids": [torch.zeros(2)], "steps": 4}, torch.device("cpu"))
    assert moved["hidden_states"].is_leaf and moved["hidden_states"].requires_grad
    assert moved["steps"] == 4 and isinstance(moved["ids"], list)


def test_a_rung_with_a_device_places_the_model_even_unmodified(monkeypatch):
    workload = build_workload(JOB)
    placed = []
    real_apply = memfit.apply

    def recording_apply(model, config, **kw):
        placed.append((config, kw.get("device")))
        return real_apply(model, config, **kw)

    monkeypatch.setattr(memfit, "apply", recording_apply)
    # on CPU the device the model is on moves nothing: what is checked is that every rung goes through apply
    m = measure_step(
        workload.model,
        workload.inputs,
        workload.loss,
        config=None,
        adapter=workload.adapter,
        warmup=0,
        steps=1,
        device=torch.device("cpu"),
    )
    assert m.frames == 0 and placed == [({"gradient_checkpointing": False}, None)]


def test_a_placement_that_does_not_fit_is_an_out_of_memory_row():
    workload = build_workload(JOB)

    def placement_fails(*args, **kwargs):
        assert kwargs["device"] == torch.device("cpu")
        raise memfit.DeviceMemoryError(
            "memfit.apply(..., device='cuda:0'): the rest (20.00 GiB) does not fit"
        )

    failure = measure_guarded(
        workload.model,
        workload.inputs,
        workload.loss,
        config={"gradient_checkpointing": True},
        adapter=workload.adapter,
        measure=placement_fails,
        device=torch.device("cpu"),
    )
    assert failure.kind is FailureKind.OUT_OF_MEMORY and "does not fit" in failure.message
