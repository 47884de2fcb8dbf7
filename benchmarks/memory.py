"""Peak resident memory of the current process image."""

from __future__ import annotations


def peak_rss_mib() -> float:
    """VmHWM of this process, in MiB.

    Not `resource.getrusage(...).ru_maxrss`: on Linux that survives `exec`, so a child started by
    a large parent reports the parent's peak. VmHWM belongs to the current memory map, which
    `exec` replaces, so it is the child's own peak.
    """
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("/proc/self/status has no VmHWM line; peak RSS needs Linux")
