"""The copy engine and what parks through it (``unsloth``, ``unsloth-ffn``, attention offload).

* :mod:`.session`   – :class:`OffloadSession`: one step's dedup registry, deferral and reload-ahead timeline;
* :mod:`.ahead`     – the reload-ahead rule (shared with the ``auto`` planner's peak model);
* :mod:`.regions`   – parking regions: frame entries (:class:`OffloadStash`), blocks that keep everything;
* :mod:`.attention` – :class:`AttentionOffloader`: attention's saved tensors parked, no recompute;
* :mod:`.copy`      – side-stream copies, events, packed batches;
* :mod:`.pool`      – :class:`PinnedBucketPool`: pinned staging buffers in size classes, reused across steps;
* :mod:`.hostmem`   – host RAM facts (``MemAvailable``, cgroup limits) and the default allocator.
"""

from memfit.offload.hostmem import available_host_bytes, default_host_reserve
from memfit.offload.pool import HostBuffer, PinnedBucketPool, PoolStats, size_class

__all__ = [
    "HostBuffer",
    "PinnedBucketPool",
    "PoolStats",
    "available_host_bytes",
    "default_host_reserve",
    "size_class",
]
