"""Host-side machinery of the offload backends (``unsloth``, ``unsloth-ffn``, attention offload).

* :mod:`.hostmem` – host RAM facts (``MemAvailable``, cgroup limits) and the default allocator;
* :mod:`.pool`    – :class:`PinnedBucketPool`: pinned staging buffers in size classes, reused across steps.
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
