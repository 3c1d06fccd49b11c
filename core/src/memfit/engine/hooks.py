"""Hooks shared by the region engine and the attention offloader: eager bodies, and a check that they ran."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from memfit.errors import MemfitError

# -- Hooks that never run ---------------------------------------------------------------------------------------
# Sub-block regions (FFN chains) and attention offload work through hooks on modules inside the blocks. Two
# things skip them silently, and then nothing is checkpointed or parked there: a block that already ran
# compiled before memfit was applied (Dynamo does not guard on the hooks of the submodules it inlines,
# ``torch._dynamo.config.skip_nnmodule_hook_guards``, so it keeps running the code traced without them; seen
# with attention modules), and model code that calls ``module.forward(...)`` instead of ``module(...)``. A
# forward with grad in which none of them ran is therefore an error.


class HookRuns:
    """Counts the runs of memfit's hooks on some modules (``what``: their kind, for the message) and, at the end
    of a forward with grad, requires that at least one ran."""

    __slots__ = ("what", "count", "_at_start")

    def __init__(self, what: str) -> None:
        self.what = what
        self.count = 0  # the hooks add 1 per run
        self._at_start: int | None = None  # ``count`` when a forward with grad began, else None

    def begin(self) -> None:
        """A forward with grad begins."""
        self._at_start = self.count

    def cancel(self) -> None:
        """Nothing to check (no forward with grad running, or it raised)."""
        self._at_start = None

    def end(self, modules: int) -> None:
        """The forward returned; ``modules``: how many modules carry the hooks now.

        Raises:
            MemfitError: a forward with grad ran none of them (see "Hooks that never run").
        """
        start, self._at_start = self._at_start, None
        if start is None or not modules or self.count > start:
            return
        raise MemfitError(
            f"memfit's hooks on {modules} {self.what} modules did not run in this forward, so nothing was "
            f"checkpointed or offloaded there. Either the blocks ran compiled (torch.compile, "
            f"compile_repeated_blocks) before memfit was applied, and the compiled code does not see hooks added "
            f"later: apply memfit before the first compiled forward, or call torch._dynamo.reset() after "
            f"memfit.apply(). Or the model calls these modules as module.forward(...), which skips hooks: declare "
            f"boundaries it calls as module(...)."
        )


def eager_hook(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run eagerly even inside a ``torch.compile``d module (a graph break, never traced)."""
    return torch.compiler.disable(fn, recursive=True)
