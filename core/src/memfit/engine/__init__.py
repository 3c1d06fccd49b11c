"""The region engine: one mechanism for every scope (block, interval chunk, FFN chain).

Modules, each with one job:

* :mod:`.state`    – thread-local flags (recomputing, inside a region call) and the held-bytes listeners;
* :mod:`.replay`   – capture and restore RNG and autocast state for a call;
* :mod:`.stash`    – where a region's entry tensors live between forward and recompute;
* :mod:`.frame`    – the frame: records calls, swaps saved tensors for handles, recomputes;
* :mod:`.schedule` – interval / segment-stride plan: which blocks are checkpointed, in which chunk;
* :mod:`.hooks`    – eager hook bodies, and the check that hooks on sub-block modules ran;
* :mod:`.install`  – the :class:`RegionEngine`: block entry (diffusers checkpoint func or hooks) and region
  hooks, removable (:func:`memfit.install.install` builds it from a plan).
"""
