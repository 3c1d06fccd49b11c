"""Measure rungs in a child process, so that a CUDA fault ends one rung, not the ladder.

After an illegal memory access (or a launch failure, a device-side assert) the CUDA context of the process is
lost: nothing more runs there. :class:`ChildRunner` keeps one measuring process that builds the workload once
and measures rung after rung; an out-of-memory rung stays in it (the memory is released). When a rung faults
(the child reports it and exits) or the child dies outright (a segfault, an abort), the rung becomes a
"crashed" row and the next rung starts a fresh child, which builds the workload again. Rebuilding is paid only
after a fault: weights are created on the device in their own dtype, seconds for a 12B model.

The child's stdout and stderr go to a temporary file: what a dying CUDA process prints (C++ stack traces) does
not reach the user; its last line names the crash when the child could not say it itself.

Children come from a fork server that has imported torch and the installed adapters once (CUDA untouched), so
starting one costs a fork, not a fresh interpreter's imports.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import tempfile
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from memfit.errors import MemfitError
from memfit.fit import InProcessRunner, Rung
from memfit.measure import FailureKind, RungFailure, StepMeasurement, first_line, sdpa_description

BUILD_TIMEOUT_S = 1800.0  # building a model, imports included
RUNG_TIMEOUT_S = 1800.0  # one rung: apply + 1 warm-up + the timed steps


class SetupError(MemfitError):
    """The measuring process could not build the workload.

    Attributes:
        out_of_memory: the weights themselves did not fit.
    """

    def __init__(self, message: str, *, out_of_memory: bool = False) -> None:
        super().__init__(message)
        self.out_of_memory = out_of_memory


def _worker(conn: Connection, build: Callable[[], Any], steps: int, sdpa: str, stderr_path: str) -> None:
    """The child: build the workload, then measure the rungs the parent sends until told to stop."""
    import torch

    fd = os.open(stderr_path, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 1)  # nothing the child's libraries print reaches the user's terminal
    os.dup2(fd, 2)
    try:
        workload = build()
    except torch.OutOfMemoryError as exc:
        conn.send(("setup_error", first_line(exc), True))
        os._exit(0)
    except Exception as exc:  # reported to the parent, which raises it there
        conn.send(
            (
                "setup_error",
                first_line(exc)
                if isinstance(exc, MemfitError)
                else f"{type(exc).__name__}: {first_line(exc)}",
                False,
            )
        )
        os._exit(0)
    device = workload.train_device
    conn.send(
        ("ready", {**workload.info, "device_type": device.type, "sdpa": sdpa_description(sdpa, device)})
    )
    runner = InProcessRunner.of(workload, steps=steps, sdpa=sdpa)
    while True:
        try:
            message = conn.recv()
        except EOFError:
            break
        if message[0] != "measure":
            break
        outcome = runner.measure(message[1], lambda phase: conn.send(("phase", phase)))
        conn.send(("result", outcome))
        if isinstance(outcome, RungFailure) and outcome.needs_fresh_process:
            break
    conn.close()
    # skip interpreter teardown: with a lost CUDA context, destructors abort and print C++ stack traces
    os._exit(0)


class ChildRunner:
    """Measures rungs in a child process that builds the workload itself (see the module docstring).

    Args:
        build: a picklable zero-argument callable returning a :class:`memfit.job.Workload` (e.g.
            ``functools.partial(memfit.job.build_workload, job)``); it runs in the child.
        steps: timed steps per rung.
        sdpa: the attention backend to pin (``memfit.measure.SDPA_CHOICES``).
        build_timeout_s, rung_timeout_s: a child silent for longer is killed; the rung is "crashed".

    Example:
        >>> with ChildRunner(partial(build_workload, job), steps=3, sdpa="flash") as runner:
        ...     info = runner.start()
        ...     report = run_ladder(runner, adapter=..., budget_bytes=..., device_type=info["device_type"])
    """

    def __init__(
        self,
        build: Callable[[], Any],
        *,
        steps: int = 3,
        sdpa: str = "default",
        build_timeout_s: float = BUILD_TIMEOUT_S,
        rung_timeout_s: float = RUNG_TIMEOUT_S,
    ) -> None:
        self._build, self._steps, self._sdpa = build, steps, sdpa
        self._build_timeout, self._rung_timeout = build_timeout_s, rung_timeout_s
        # CUDA cannot be forked from an initialised process; a fork server (which never touches CUDA) can:
        # it imports torch and the adapters once, and every measuring child starts from that copy.
        self._ctx = multiprocessing.get_context("forkserver")
        self._ctx.set_forkserver_preload(["memfit._fit_child_preload"])
        self._proc: Any = None
        self._conn: Connection | None = None
        fd, self._stderr_path = tempfile.mkstemp(prefix="memfit-fit-child-", suffix=".log")
        os.close(fd)
        self.starts = 0  # how many children were started (the first, plus one after each fault)
        self.info: dict[str, Any] = {}

    # -- lifecycle ----------------------------------------------------------------------------------------------

    def start(self) -> dict[str, Any]:
        """Start a child and wait until it has built the workload; returns what it reported (device, weights,
        build time …).

        Raises:
            SetupError: the child could not build the workload (the message says why).
        """
        with open(self._stderr_path, "w"):  # a fresh log: the last line must be this child's
            pass
        parent, child = self._ctx.Pipe()
        self._proc = self._ctx.Process(
            target=_worker,
            args=(child, self._build, self._steps, self._sdpa, self._stderr_path),
            daemon=True,
        )
        self._proc.start()
        child.close()
        self._conn = parent
        self.starts += 1
        message = self._receive(self._build_timeout)
        if message is None or message[0] != "ready":
            self._stop()
            if message is not None and message[0] == "setup_error":
                raise SetupError(message[1], out_of_memory=message[2])
            raise SetupError(f"the measuring process died while building the model ({self._death()})")
        self.info = message[1]
        return self.info

    def close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(OSError):
                self._conn.send(("close",))
        self._stop()
        with contextlib.suppress(OSError):
            os.unlink(self._stderr_path)

    def __enter__(self) -> ChildRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- measuring ----------------------------------------------------------------------------------------------

    def measure(
        self, rung: Rung, on_phase: Callable[[str], None] = lambda _p: None
    ) -> StepMeasurement | RungFailure:
        if self._proc is None:
            try:
                self.start()
            except SetupError as exc:  # a fresh child after a fault could not even build: this rung crashed
                return RungFailure(
                    FailureKind.CRASHED, f"could not restart the measuring process: {exc}", "build"
                )
        assert self._conn is not None
        try:
            self._conn.send(("measure", rung))
        except OSError:
            return self._crashed(None)
        phase: str | None = None
        while True:
            message = self._receive(self._rung_timeout)
            if message is None:
                return self._crashed(phase)
            if message[0] == "phase":
                phase = message[1]
                on_phase(phase)
                continue
            outcome = message[1]
            if isinstance(outcome, RungFailure) and outcome.needs_fresh_process:
                self._stop()  # the child exits by itself; the next rung gets a fresh one
            return outcome

    def _receive(self, timeout: float) -> tuple[Any, ...] | None:
        """The child's next message; None if it died or said nothing for ``timeout`` seconds (then it is
        killed)."""
        assert self._conn is not None
        try:
            if not self._conn.poll(timeout):
                self._kill()
                return None
            return self._conn.recv()
        except (EOFError, OSError):
            return None

    def _crashed(self, phase: str | None) -> RungFailure:
        reason = self._death()
        self._stop()
        return RungFailure(FailureKind.CRASHED, reason, phase, context_lost=True)

    def _death(self) -> str:
        """How the child ended, for the row: its exit signal or code, and the last line it printed."""
        proc = self._proc
        if proc is not None:
            proc.join(10)
            if proc.is_alive():
                self._kill()
        code = proc.exitcode if proc is not None else None
        if code is None:
            how = f"the measuring process stopped answering and was killed after {self._rung_timeout:.0f} s"
        elif code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            how = f"the measuring process died ({name})"
        else:
            how = f"the measuring process exited with code {code}"
        last = _last_line(self._stderr_path)
        return f"{how}: {last}" if last else how

    def _kill(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            self._proc.kill()
            self._proc.join(10)

    def _stop(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._proc is not None:
            self._proc.join(10)
            self._kill()
            self._proc = None


def _last_line(path: str) -> str:
    """The last non-empty line of the child's stderr (at most 200 characters)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 4096))
            lines = [ln.strip() for ln in fh.read().decode("utf-8", "replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1][:200] if lines else ""


__all__ = ["ChildRunner", "SetupError"]
