"""The model folder's storage: which device it is on, what kind (an SD card reads ~44 MB/s on a Pi 4, NVMe on a
Pi 5 400-800 MB/s), and its sequential read speed, measured once per device and kept in the state directory.

The kind is read through the ``SystemSource`` (so recorded machines drive it): on Linux the mount that holds the
folder (``/proc/self/mountinfo``), its block device (``/sys/dev/block/MAJ:MIN``, a partition's disk, a
device-mapper volume's first slave), and the disk's name and sysfs path: ``mmcblk*`` an SD card (``eMMC`` when
``device/type`` says MMC), ``nvme*`` NVMe, a path through ``/usb`` USB, ``vd*`` or virtio a VM's disk, else
``queue/rotational`` tells an HDD from an SSD. On macOS ``diskutil info`` of the volume (once a minute at most,
through ``SystemSource.command``).

The speed is measured on this machine only, bounded in time (``measure``): a large file already in the folder
(a .gguf) read with O_DIRECT where the filesystem allows it (macOS: F_NOCACHE), so the page cache never
answers and a serving node's cached pages are left alone; where it does not, the file's pages are dropped first
(``posix_fadvise(DONTNEED)``: pages another process maps stay cached, and the figure says so in its method). With
no large file, a temporary file is written (for at most about a second), synced, dropped from the cache and read
back (in the nearest existing folder above it when the model folder is not made yet; nothing is made). The
result is kept in ``storage.json`` under the device's key (its name and serial: another SD card in the
slot is another device), so it is measured once, never in the hot path.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys as _sys
import tempfile
import time
from pathlib import Path
from typing import Any

from nodeagent.hardware.system import LiveSystem, SystemSource
from nodeagent.hardware.types import Storage

log = logging.getLogger(__name__)

CACHE_FILE = "storage.json"
MIB = 1 << 20
BUDGET_S = 3.0  # the whole measurement: the read stops when this is spent
READ_MAX_BYTES = 256 * MIB  # read at most this much of a file
LARGE_FILE_BYTES = 64 * MIB  # a file this large in the folder is read; else a temporary one is written
WRITE_MAX_S = 1.0  # a temporary file is written for at most this long
WRITE_MAX_BYTES = 128 * MIB
CHUNK = 4 * MIB


# -- which device, what kind -------------------------------------------------------------------------------------
def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _mount(sys: SystemSource, folder: str) -> tuple[str, str, str, str] | None:
    """(mount point, MAJ:MIN, filesystem, source) of the mount holding ``folder`` (the longest mount point that
    is a prefix of it), from /proc/self/mountinfo."""
    best = None
    for line in (sys.read_text("/proc/self/mountinfo") or "").splitlines():
        left, sep, right = line.partition(" - ")
        a, b = left.split(), right.split()
        if not sep or len(a) < 5 or len(b) < 2:
            continue
        point = _unescape(a[4])
        inside = folder == point or folder.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best[0])):  # the later of equal mounts is on top
            best = (point, a[2], b[0], _unescape(b[1]))
    return best


_PARTITION = re.compile(r"^((?:mmcblk|nvme\d+n|loop|md)\d+)p\d+$|^((?:sd|vd|xvd|hd)[a-z]+)\d+$")


def _disk_of(sys: SystemSource, majmin: str, source: str, depth: int = 0) -> tuple[str, str] | None:
    """(disk name, its sysfs path) for a mount's device: through /sys/dev/block/MAJ:MIN where it resolves, else
    the source's name less its partition number."""
    path = sys.realpath(f"/sys/dev/block/{majmin}") if majmin and not majmin.startswith("0:") else None
    if path:
        parts = path.rstrip("/").split("/")
        name = parts[-1]
        if len(parts) >= 2 and parts[-2] != "block" and sys.read_text(f"{path}/partition") is not None:
            name, path = parts[-2], "/".join(parts[:-1])  # a partition: its disk
    elif source.startswith("/dev/") and source != "/dev/root":
        name = source[len("/dev/"):].split("/")[-1]
        m = _PARTITION.match(name)
        if m:
            name = m.group(1) or m.group(2)
        path = sys.realpath(f"/sys/block/{name}") or f"/sys/block/{name}"
    else:
        return None
    slaves = sys.glob(f"/sys/block/{name}/slaves/*")
    if slaves and depth < 3:  # device mapper (LVM, LUKS): the first device under it
        return _disk_of(sys, "", "/dev/" + slaves[0].rsplit("/", 1)[-1], depth + 1)
    return name, path


def _kind(sys: SystemSource, name: str, path: str) -> str | None:
    if "/usb" in path:
        return "usb"
    if name.startswith("mmcblk"):
        return "emmc" if (sys.read_text(f"/sys/block/{name}/device/type") or "").strip() == "MMC" else "sd"
    if name.startswith("nvme"):
        return "nvme"
    if name.startswith(("vd", "xvd")) or "/virtio" in path:
        return "virtual"
    if name.startswith(("loop", "zram", "ram")):
        return None
    rotational = (sys.read_text(f"/sys/block/{name}/queue/rotational") or "").strip()
    return {"1": "hdd", "0": "ssd"}.get(rotational)


def _serial(sys: SystemSource, name: str) -> str | None:
    for leaf in ("device/cid", "device/serial", "wwid", "device/wwid", "serial"):
        text = (sys.read_text(f"/sys/block/{name}/{leaf}") or "").strip()
        if text:
            return " ".join(text.split())[:64]
    return None


def _volume(folder: str) -> str:
    """A macOS folder's volume: /Volumes/NAME for a folder there, else the startup volume (the Data volume shares
    its disk)."""
    parts = folder.split("/")
    return "/".join(parts[:3]) if folder.startswith("/Volumes/") and len(parts) > 2 else "/"


def _darwin(sys: SystemSource, folder: str) -> tuple[str | None, str | None, str | None]:
    """(device, kind, key) from ``diskutil info`` of the folder's volume."""
    text = sys.command(["diskutil", "info", _volume(folder)]) or ""
    fields = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in text.splitlines()) if v}
    device = fields.get("Part of Whole") or fields.get("Device Identifier")
    protocol = fields.get("Protocol", "")
    solid = fields.get("Solid State")
    if "USB" in protocol:
        kind = "usb"
    elif "Secure Digital" in protocol:
        kind = "sd"
    elif any(p in protocol for p in ("PCI", "Apple Fabric", "NVMe")):
        kind = "nvme"
    elif solid in ("Yes", "No"):
        kind = "ssd" if solid == "Yes" else "hdd"
    else:
        kind = None
    key = f"{device}/{fields.get('Disk / Partition UUID') or fields.get('Volume UUID') or ''}" if device else None
    return device, kind, key


def locate(sys: SystemSource, folder: str) -> Storage:
    """The folder's device and its kind (no measurement)."""
    if sys.system() == "darwin":
        device, kind, key = _darwin(sys, folder)
        return Storage(path=folder, device=device, kind=kind, key=key)  # type: ignore[arg-type]
    mount = _mount(sys, folder)
    if mount is None:
        return Storage(path=folder)
    point, majmin, fstype, source = mount
    disk = _disk_of(sys, majmin, source)
    if disk is None:  # overlay, tmpfs, a network filesystem: no block device of its own here
        return Storage(path=folder, key=f"{fstype}:{source}@{point}")
    name, path = disk
    serial = _serial(sys, name)
    return Storage(path=folder, device=name, kind=_kind(sys, name, path),  # type: ignore[arg-type]
                   key=f"{name}/{serial}" if serial else name)


# -- the cache -----------------------------------------------------------------------------------------------------
def load_cache(state_dir: Path) -> dict[str, Any]:
    try:
        data = json.loads((Path(state_dir) / CACHE_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def remember(state_dir: Path, key: str, entry: dict[str, Any]) -> Path:
    """Keep one device's measurement in storage.json (written whole, then renamed: never half a file)."""
    path = Path(state_dir) / CACHE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    data = load_cache(state_dir)
    data[key] = entry
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".storage-")
    with os.fdopen(fd, "w") as fh:
        json.dump(data, fh, indent=1)
    os.replace(tmp, path)
    return path


def forget(state_dir: Path, storage: Storage | None) -> None:
    """Drop a device's measurement from the cache (the next ``storage_info(measure_now=True)`` measures it)."""
    if storage is None or storage.key is None:
        return
    data = load_cache(state_dir)
    if data.pop(storage.key, None) is not None:
        path = Path(state_dir) / CACHE_FILE
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".storage-")
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh, indent=1)
        os.replace(tmp, path)


def storage_info(sys: SystemSource, folder: str, state_dir: Path | None, measure_now: bool = False,
                 budget_s: float = BUDGET_S) -> Storage:
    """The folder's storage with its measured speed from the cache; ``measure_now``: measure it when the cache
    has no figure for this device (this machine only: a recorded one is never measured), and keep it. On macOS
    this machine's volume is asked of ``diskutil`` once and kept in the cache too."""
    live_mac = isinstance(sys, LiveSystem) and sys.system() == "darwin" and state_dir is not None
    known = load_cache(state_dir).get(f"volume {_volume(folder)}") if live_mac else None  # type: ignore[arg-type]
    if known:
        s = Storage(path=folder, device=known.get("device"), kind=known.get("kind"), key=known.get("key"))
    else:
        s = locate(sys, folder)
        if live_mac and s.device:
            remember(state_dir, f"volume {_volume(folder)}",  # type: ignore[arg-type]
                     {"device": s.device, "kind": s.kind, "key": s.key})
    if state_dir is None or s.key is None:
        return s
    entry = load_cache(state_dir).get(s.key)
    if entry is None and measure_now and isinstance(sys, LiveSystem):
        try:
            entry = measure(Path(folder), budget_s)
        except OSError as exc:
            log.warning("could not measure the storage of %s: %s", folder, exc)
            entry = None
        if entry is not None:
            entry = {**entry, "device": s.device, "kind": s.kind}
            remember(state_dir, s.key, entry)
            log.info("storage of %s (%s, %s): %.1f MB/s sequential read (%s)", folder, s.device, s.kind,
                     entry["read_mb_s"], entry["method"])
    if not entry:
        return s
    return s.model_copy(update={"read_mb_s": entry.get("read_mb_s"), "measured_at": entry.get("measured_at"),
                                "method": entry.get("method")})


# -- the measurement -----------------------------------------------------------------------------------------------
def _large_file(folder: Path) -> Path | None:
    """The largest file of at least LARGE_FILE_BYTES under the folder (a .gguf first), looking at no more than a
    few thousand entries."""
    best: tuple[int, int, Path] | None = None
    seen = 0
    for root, dirs, files in os.walk(folder):
        for f in files:
            seen += 1
            p = Path(root) / f
            try:
                size = p.stat().st_size
            except OSError:
                continue
            if size >= LARGE_FILE_BYTES and p.is_file():
                key = (int(p.suffix == ".gguf"), size, p)
                best = key if best is None or key[:2] > best[:2] else best
        if seen > 5000:
            break
    return best[2] if best else None


def _open_uncached(path: Path) -> tuple[int, str]:
    """A descriptor whose reads bypass the page cache where the OS allows it, and how."""
    if hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, os.O_RDONLY | os.O_DIRECT), "O_DIRECT (no page cache)"
        except OSError:
            pass
    fd = os.open(path, os.O_RDONLY)
    if _sys.platform == "darwin":
        import fcntl

        try:
            fcntl.fcntl(fd, getattr(fcntl, "F_NOCACHE", 48), 1)
            return fd, "F_NOCACHE (no page cache)"
        except OSError:
            pass
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return fd, "its pages dropped from the page cache first (posix_fadvise DONTNEED)"
    return fd, "the page cache could not be kept out: the figure may be the cache's"


def _timed_read(path: Path, deadline: float, limit: int) -> tuple[int, float, str]:
    """(bytes, seconds, how) of a sequential read from the start of ``path`` until ``limit`` bytes, the end of
    the file, or ``deadline`` (monotonic)."""
    import mmap

    fd, how = _open_uncached(path)
    buf = mmap.mmap(-1, CHUNK)  # page-aligned, as O_DIRECT needs
    done = 0
    started = time.monotonic()
    try:
        while done < limit and time.monotonic() < deadline:
            try:
                n = os.preadv(fd, [buf], done)
            except OSError:
                if "O_DIRECT" not in how:
                    raise
                os.close(fd)  # the filesystem took the flag but refuses the reads: read through the cache
                fd = os.open(path, os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                how = "its pages dropped from the page cache first (posix_fadvise DONTNEED)"
                done, started = 0, time.monotonic()
                continue
            if n <= 0:
                break
            done += n
    finally:
        os.close(fd)
        buf.close()
    return done, time.monotonic() - started, how


def measure(folder: Path, budget_s: float = BUDGET_S) -> dict[str, Any] | None:
    """The folder's device's sequential read speed, within about ``budget_s``: a large file of the folder read
    without the page cache, or a temporary file written, synced, dropped and read back. None when there is
    nothing to read and the folder cannot be written."""
    started = time.monotonic()
    target = _large_file(folder) if folder.is_dir() else None
    made = None
    if target is None:
        where = folder  # a folder not made yet: the nearest one above it (the same device, as the mounts say)
        while not where.is_dir() and where != where.parent:
            where = where.parent
        try:
            fd, name = tempfile.mkstemp(dir=where, prefix=".nodeagent-storage-")
        except OSError:
            return None
        made = Path(name)
        block = os.urandom(CHUNK)  # not zeros: a compressing filesystem or device would answer too fast
        written = 0
        try:
            while written < WRITE_MAX_BYTES and (written == 0 or time.monotonic() - started < WRITE_MAX_S):
                written += os.write(fd, block)
            os.fsync(fd)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        target = made
    try:
        left = max(0.5, budget_s - (time.monotonic() - started))
        n, seconds, how = _timed_read(target, time.monotonic() + left, READ_MAX_BYTES)
    finally:
        if made is not None:
            made.unlink(missing_ok=True)
    if n == 0 or seconds <= 0:
        return None
    what = (f"a temporary file of {n / MIB:.0f} MiB written, synced and read back" if made is not None
            else f"{n / MIB:.0f} MiB of {target.name} read")
    return {"read_mb_s": round(n / seconds / 1e6, 1), "bytes": n, "seconds": round(seconds, 3),
            "measured_at": round(time.time(), 1), "method": f"{what}, {how}", "folder": str(folder)}
