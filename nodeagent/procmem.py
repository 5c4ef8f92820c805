"""This process's memory: resident, peak, file-backed vs anonymous."""

from __future__ import annotations

import resource
import sys

from nodeagent.values import Frozen

KIB = 1024


class ProcessMemory(Frozen):
    rss_bytes: int
    peak_rss_bytes: int
    anon_bytes: int | None = None  # RssAnon (Linux)
    file_bytes: int | None = None  # RssFile: memory-mapped weights live here


def process_memory() -> ProcessMemory:
    status: dict[str, int] = {}
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                    status[key] = int(value.split()[0]) * KIB
    except OSError:
        pass
    if "VmRSS" in status:
        return ProcessMemory(rss_bytes=status["VmRSS"], peak_rss_bytes=status["VmHWM"],
                             anon_bytes=status.get("RssAnon"), file_bytes=status.get("RssFile"))
    import psutil

    rss = psutil.Process().memory_info().rss
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak_bytes = peak if sys.platform == "darwin" else peak * KIB  # bytes on macOS, KiB on Linux
    return ProcessMemory(rss_bytes=rss, peak_rss_bytes=max(rss, peak_bytes))

