"""memfit on a model sharded with FSDP2 (``fully_shard``): 2 gloo ranks on CPU, tiny Flux.

All scenarios run in one spawn (see ``fsdp_worker.py``); each test checks one of them.
"""

from __future__ import annotations

import json
import socket

import pytest

pytest.importorskip("diffusers")
pytest.importorskip("memfit_flux")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():  # pragma: no cover
    pytest.skip("torch.distributed with gloo is needed", allow_module_level=True)

import fsdp_worker  # noqa: E402  (core/tests is on sys.path: conftest.py)
import torch.multiprocessing as mp  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp2") / "results.json"
    mp.spawn(fsdp_worker.run, args=(2, free_port(), str(out)), nprocs=2, join=True)
    return json.loads(out.read_text())


def assert_same(r: dict) -> None:
    assert r["loss_equal"], r
    assert r["same_grad_names"], r
    assert r["full_grads_equal"] and r["local_shards_equal"], r


@pytest.mark.parametrize("backend,interval", fsdp_worker.CASES)
def test_backends_match_unmodified_sharded_run(results, backend, interval):
    r = results[f"{backend}/{interval}"]
    assert_same(r)
    assert r["recomputes"] > 0  # really checkpointed, not a no-op


@pytest.mark.parametrize("name", ["unsloth/2", "attention-offload"])
def test_offload_logic_under_fsdp_with_cpu_copy_engine(results, name):
    r = results[name]
    assert_same(r)
    assert r["bytes_offloaded"] > 0
    assert r["sharded_params_untouched"]


@pytest.mark.parametrize("backend", ["unsloth", "unsloth-ffn"])
def test_offload_backends_need_cuda_when_sharded(results, backend):
    msg = results[f"cuda-error/{backend}"]
    assert msg is not None and "CUDA" in msg and "torch-ffn" in msg


def test_fully_shard_after_apply_is_refused_with_the_fix(results):
    msg = results["wrong-order"]
    assert msg is not None
    assert "after memfit.apply" in msg and "handle.remove()" in msg
    # the fix in the message works
    assert_same(results["after-remove-reapply"])


def test_fsdp_activation_checkpointing_disables_ours_with_one_warning(results):
    r = results["fsdp-ac"]
    assert len(r["warnings"]) == 1 and "FSDP activation checkpointing" in r["warnings"][0]
    assert r["enabled"] is False and r["recomputes"] == 0
    assert_same(r)
