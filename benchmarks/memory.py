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


def rss_parts_mib() -> dict[str, float]:
    """Current RssAnon (heap, owned by the process) and RssFile (pages of mapped files), in MiB."""
    parts = {}
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(("RssAnon:", "RssFile:")):
                key, value = line.split()[:2]
                parts[key.rstrip(":")] = int(value) / 1024
    return parts


class PeakSampler:
    """Samples RssAnon and RssFile in a background thread and keeps each one's peak.

    VmHWM counts the pages of memory-mapped files (e.g. safetensors shards read lazily); those
    are page cache the kernel can drop, not memory the process holds. The peak of RssAnon is
    what the process itself allocated.
    """

    def __init__(self, interval_s: float = 0.02):
        import threading

        self.interval_s = interval_s
        self.peaks = {"RssAnon": 0.0, "RssFile": 0.0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval_s)

    def _sample(self):
        for key, value in rss_parts_mib().items():
            self.peaks[key] = max(self.peaks[key], value)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._sample()
        return False
