"""Host (CPU) memory facts and the default host allocator of the pinned pool.

Design notes
------------
Available RAM.  :func:`available_host_bytes` reads ``MemAvailable`` from
``/proc/meminfo`` (Linux ≥ 3.14): the kernel's own estimate of what can be
allocated without swapping, page cache included. Elsewhere it falls back to
``psutil`` when installed, then to ``sysconf`` free pages; when nothing can be read
it answers "unknown" as a very large number, so the pool's check passes instead of
blocking a machine whose memory it cannot see. cgroup (container) limits are
honoured where cgroup v2 or v1 exposes them: a job in a 64 GiB container on a
1 TiB host has 64 GiB, not 1 TiB.

Allocation.  :func:`allocate_host` page-locks an ordinary allocation with
``cudaHostRegister``: exactly the bytes asked for. (PyTorch's ``pin_memory=True`` goes
through its caching host allocator, which rounds every request up to a power of two:
a 137 MiB activation pinned 256 MiB, and on a 128 GiB host a video model's attention
offload ran out of RAM at half the data it could have held.) The registration is undone
when the buffer's tensor is freed.
"""

from __future__ import annotations

import os
import sys
import weakref

import torch

_UNKNOWN = sys.maxsize
_GIB = 1 << 30


def _read_meminfo(field: str, path: str = "/proc/meminfo") -> int | None:
    """``field`` of ``/proc/meminfo`` in bytes, or None if the file or the field is missing."""
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name == field:
                    parts = rest.split()
                    value = int(parts[0])
                    unit = parts[1].lower() if len(parts) > 1 else "b"
                    return value * 1024 if unit == "kb" else value
    except (OSError, ValueError, IndexError):
        return None
    return None


def _read_int(path: str) -> int | None:
    try:
        with open(path, encoding="ascii") as f:
            raw = f.read().strip()
    except OSError:
        return None
    if raw == "max":
        return None
    try:
        return int(raw)
    except ValueError:
        return None


def _read_stat(path: str, field: str) -> int:
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == field:
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _cgroup_dirs() -> list[tuple[str, str]]:
    """(version, directory) of this process's memory cgroup, then the mount root."""
    dirs: list[tuple[str, str]] = []
    try:
        with open("/proc/self/cgroup", encoding="ascii") as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        path = path.lstrip("/")
        if hierarchy == "0" and controllers == "":
            dirs.append(("v2", os.path.join("/sys/fs/cgroup", path)))
        elif "memory" in controllers.split(","):
            dirs.append(("v1", os.path.join("/sys/fs/cgroup/memory", path)))
    dirs += [("v2", "/sys/fs/cgroup"), ("v1", "/sys/fs/cgroup/memory")]
    return dirs


def _cgroup_headroom() -> int | None:
    """Bytes left under this process's cgroup memory limit, or None when no limit is set.

    Usage counts page cache; like ``docker stats`` the inactive file cache (which the
    kernel reclaims first) is not counted as used.
    """
    for version, d in _cgroup_dirs():
        if version == "v2":
            limit = _read_int(os.path.join(d, "memory.max"))
            usage = _read_int(os.path.join(d, "memory.current"))
            cache = _read_stat(os.path.join(d, "memory.stat"), "inactive_file")
        else:
            limit = _read_int(os.path.join(d, "memory.limit_in_bytes"))
            usage = _read_int(os.path.join(d, "memory.usage_in_bytes"))
            cache = _read_stat(os.path.join(d, "memory.stat"), "total_inactive_file")
        # v1 reports "no limit" as a huge page-rounded number
        if limit is None or usage is None or limit >= 1 << 60:
            continue
        return max(0, limit - max(0, usage - cache))
    return None


def available_host_bytes() -> int:
    """Bytes of host RAM that can still be allocated without swapping (best estimate).

    ``MemAvailable`` on Linux, bounded by the cgroup limit when one is set; ``psutil``
    or ``sysconf`` elsewhere; ``sys.maxsize`` when nothing can be read.
    """
    available = _read_meminfo("MemAvailable")
    if available is None:
        try:
            import psutil  # optional; not a dependency of memfit

            available = int(psutil.virtual_memory().available)
        except Exception:
            available = None
    if available is None:
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            available = None
    cgroup = _cgroup_headroom()
    if available is None:
        return cgroup if cgroup is not None else _UNKNOWN
    return min(available, cgroup) if cgroup is not None else available


def total_host_bytes() -> int | None:
    """Installed host RAM in bytes (``MemTotal`` / ``sysconf``), or None when unknown."""
    total = _read_meminfo("MemTotal")
    if total is not None:
        return total
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def default_host_reserve(total: int | None = None) -> int:
    """RAM the pool leaves free for the rest of the process: 10% of the host, at least 2 GiB.

    Never more than half of the host (a small CI machine must still be able to pin
    something); 2 GiB when the total is unknown.
    """
    total = total_host_bytes() if total is None else total
    if total is None:
        return 2 * _GIB
    return int(min(max(total // 10, 2 * _GIB), total // 2))


def allocate_host(nbytes: int, pinned: bool) -> torch.Tensor:
    """A 1-D ``uint8`` CPU tensor of ``nbytes`` bytes, page-locked when ``pinned`` (see the module notes).

    Raises:
        RuntimeError: pinning is impossible (no CUDA, or the driver refused to lock the pages).
    """
    tensor = torch.empty(nbytes, dtype=torch.uint8)
    if not pinned or nbytes == 0:
        return tensor
    cudart = torch.cuda.cudart()  # raises without CUDA
    ptr = tensor.data_ptr()
    status = cudart.cudaHostRegister(ptr, nbytes, 0)
    if int(status) != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error {int(status)}")
    weakref.finalize(tensor, cudart.cudaHostUnregister, ptr)
    return tensor


def torch_pinned_footprint(nbytes: int) -> int:
    """Bytes PyTorch's caching host allocator really pins for an ``nbytes`` request (for a pool given
    ``allocate=`` through ``pin_memory=True``; the default :func:`allocate_host` pins exactly ``nbytes``).

    With default settings it rounds up to the next power of two. (A process that
    raises ``pinned_max_round_threshold`` gets less; the estimate is then conservative.)
    """
    return 1 << max(0, nbytes - 1).bit_length() if nbytes > 0 else 0
