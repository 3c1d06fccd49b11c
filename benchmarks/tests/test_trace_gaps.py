"""The trace reader splits the compute stream's idle time into host-bound and dependency gaps and charges the
host-bound ones to the frames that ran."""

import gzip
import json

from memfit_benchmarks import trace_gaps


def _x(cat, name, ts, dur, *, tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": tid, "args": args}


def _kernel(ts, dur, corr, stream=7):
    return _x("kernel", "gemm", ts, dur, tid=stream, stream=stream, correlation=corr)


def _launch(ts, corr, name="cudaLaunchKernel", dur=5):
    return _x("cuda_runtime", name, ts, dur, correlation=corr)


def _trace():
    park = "/tmp/site/memfit/offload/copy.py(321): _offload_coalesced"
    return [
        _x("python_function", "train.py(10): step", 0, 1000),
        _x("python_function", park, 100, 300),
        _x("python_function", "torch/cuda/streams.py(5): record", 150, 100),
        # C calls memfit's code makes: a built-in method (the torch op inside it is its own), a bare torch op
        _x("python_function", "<built-in method cat of type object at 0x7f00aa>", 260, 40),
        _x("cpu_op", "aten::cat", 262, 36),
        _x("cpu_op", "aten::empty", 263, 2),
        _x("cpu_op", "aten::copy_", 310, 20),
        _launch(0, 1),
        _kernel(10, 90, 1),  # busy 10-100
        # launched at 100, within the busy op: the next op's 50 µs gap is a dependency (a wait)
        _launch(50, 2),
        _kernel(150, 50, 2),  # busy 150-200
        # launched at 400, after the GPU ran dry at 200: a 205 µs host-bound gap, midpoint inside the park call
        _launch(400, 3),
        _kernel(405, 95, 3),  # busy 405-500
        _launch(500, 4),
        _kernel(505, 45, 4),  # 5 µs gap: under the threshold
        # a side-stream copy with less kernel time: not the compute stream
        _x("gpu_memcpy", "Memcpy DtoH", 120, 400, tid=20, stream=20),
        _x("cuda_runtime", "cudaEventSynchronize", 600, 80),
    ]


def test_gaps_split_by_cause_and_charged_to_the_running_frames():
    r = trace_gaps.summarize("t", _trace(), min_gap_us=20)
    assert r.compute_stream == 7
    assert r.busy_us == 90 + 50 + 95 + 45
    assert r.gaps == 2
    assert r.dependency_gap_us == 50
    assert r.host_gap_us == 205
    # midpoint 302.5: inside the park call (100-400), past the record call (150-250)
    assert r.host_gap_by_memfit_frame == {"memfit/offload/copy.py: _offload_coalesced": 205}
    assert r.host_gap_by_innermost_frame == {"memfit/offload/copy.py: _offload_coalesced": 205}
    assert r.runtime_calls["cudaEventSynchronize"] == (1, 80, 80)
    assert r.runtime_calls["cudaLaunchKernel"][0] == 4
    assert r.memfit_python_us == 300
    park = "memfit/offload/copy.py: _offload_coalesced"
    assert r.memfit_inclusive_us == {park: 300}
    assert r.memfit_own_us == {park: 300 - 100 - 40 - 20}  # less the Python call and the two C calls
    assert r.calls_from_memfit == {"<built-in method cat of type object>": (1, 40), "aten::copy_": (1, 20)}


def test_a_recursive_memfit_function_counts_once_inclusive():
    frames = [
        trace_gaps.Interval(0, 100, "/x/memfit/a.py(1): f"),
        trace_gaps.Interval(10, 60, "/x/memfit/a.py(1): f"),
        trace_gaps.Interval(20, 30, "/x/memfit/b.py(2): g"),
    ]
    inclusive, own, calls = trace_gaps.memfit_breakdown(frames, [])
    assert inclusive == {"memfit/a.py: f": 100, "memfit/b.py: g": 10}
    assert own == {"memfit/a.py: f": (100 - 50) + (50 - 10), "memfit/b.py: g": 10}
    assert calls == {}


def test_a_gap_outside_memfit_is_charged_to_the_harness():
    events = [
        _x("python_function", "train.py(10): step", 0, 1000),
        _launch(0, 1),
        _kernel(10, 10, 1),
        _launch(200, 2),
        _kernel(210, 10, 2),
    ]
    r = trace_gaps.summarize("t", events)
    assert r.host_gap_by_memfit_frame == {"(outside memfit)": 190}
    assert r.host_gap_by_innermost_frame == {"train.py: step": 190}


def test_stacks_follow_nesting():
    frames = [
        trace_gaps.Interval(0, 100, "a"),
        trace_gaps.Interval(10, 20, "b"),
        trace_gaps.Interval(30, 60, "c"),
        trace_gaps.Interval(40, 50, "d"),
    ]
    stacks = trace_gaps._stacks_at(frames, [5, 15, 25, 45, 55, 200])
    assert [[f.name for f in s] for s in stacks] == [
        ["a"],
        ["a", "b"],
        ["a"],
        ["a", "c", "d"],
        ["a", "c"],
        [],
    ]


def test_reads_gzipped_traces_and_renders(tmp_path, capsys):
    path = tmp_path / "trace-synthetic-1024-offload_attention.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": _trace() + [{"ph": "s", "name": "flow"}]}, f)
    out = tmp_path / "gaps.md"
    trace_gaps.main([str(path), "--out", str(out)])
    text = out.read_text()
    assert "| trace-synthetic-1024-offload_attention | " in text
    assert "- 0.20 ms  memfit/offload/copy.py: _offload_coalesced" in text  # 205 µs
    assert "| cudaEventSynchronize | 1 | 0.08 | 80 |" in text
    assert "| memfit/offload/copy.py: _offload_coalesced | 0.30 | 0.14 |" in text
    assert "| <built-in method cat of type object> | 1 | 0.04 |" in text
    assert text == capsys.readouterr().out
