"""The memory-timeline replay on a hand-made allocator trace: its peak, its phase and what is alive there."""

from __future__ import annotations

from memfit_benchmarks.memtimeline import _MARKER, replay

MODEL = [
    {"filename": "/x/memfit_benchmarks/synthetic.py", "line": 26, "name": "forward"},
    {"filename": "/x/torch/nn/modules/module.py", "line": 1, "name": "_call_impl"},
]
TORCH_ONLY = [{"filename": "/x/torch/autograd/__init__.py", "line": 3, "name": "backward"}]


def _alloc(addr, size, frames=MODEL):
    return {"action": "alloc", "addr": addr, "size": size, "frames": frames}


def _free(addr, size, action="free_requested"):
    return {"action": action, "addr": addr, "size": size}


def test_the_peak_its_phase_and_the_blocks_alive_there():
    trace = [
        _alloc(1, 100),
        _alloc(2, 100),  # forward: two saved activations
        _alloc(3, 512, [{"filename": "/x/memfit_benchmarks/memtimeline.py", "line": 9, "name": _MARKER}]),
        _free(3, 512),
        _alloc(4, 300, TORCH_ONLY),  # backward: a gradient
        _free(4, 300),
        _free(2, 100),
        _alloc(5, 50, TORCH_ONLY),
        _free(1, 100),
        _free(5, 50),
    ]
    r = replay(trace, baseline=1000)
    assert r["peak"] == 1000 + 100 + 100 + 300
    assert r["phase"] == "backward" and r["peak_event"] == 4 and r["forward_end_event"] == 2
    assert r["peak_allocation"] == "(autograd engine)"
    assert {(g["size"], g["count"], g["when"]) for g in r["alive_at_peak"]} == {
        (100, 2, "forward"),
        (300, 1, "backward"),
    }
    assert (
        next(g for g in r["alive_at_peak"] if g["size"] == 100)["where"]
        == "memfit_benchmarks/synthetic.py:26 forward"
    )
    assert r["end"] == 1000 and r["held_by_memfit_at_peak"] == 0


def test_what_memfit_itself_allocated_is_counted_apart():
    ours = [{"filename": "/x/memfit/offload/copy.py", "line": 330, "name": "reload_many"}]
    r = replay([_alloc(1, 64, ours), _alloc(2, 32)], baseline=0)
    assert r["peak"] == 96 and r["held_by_memfit_at_peak"] == 64


def test_a_block_freed_on_request_but_completed_later_counts_until_completed_in_that_replay():
    trace = [
        _alloc(1, 100),
        _free(1, 100),
        _alloc(2, 100),
        _free(1, 100, "free_completed"),
        _free(2, 100),
        _free(2, 100, "free_completed"),
    ]
    assert replay(trace, baseline=0)["peak"] == 100
    assert replay(trace, baseline=0, free_action="free_completed")["peak"] == 200


def test_the_lease_job_names_its_modes_and_shape(lease, tmp_path):
    job_command = lease.job_command
    cmd = job_command("memtimeline=torch+unsloth+offload_attention,shape=1", tmp_path)
    assert cmd[cmd.index("--modes") + 1] == "torch,unsloth,offload_attention"
    assert cmd[cmd.index("--shape") + 1] == "1"
    assert "--modes" not in job_command("memtimeline", tmp_path)
