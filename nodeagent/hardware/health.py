"""The device's health now: heat, the CPU's clock against its maximum, power, memory pressure, the clock's sync
and the model folder's storage: what makes a Pi or a Mac slow, unstable or the wrong place for work, where RAM
and cores do not show it.

Read through the same ``SystemSource`` as the probe, so recorded machines drive it, and cheaply: files, and on
macOS ``sysctlbyname`` and ``notify_get_state`` (no process); ``pmset`` at most once a minute (the source keeps
its output). Whatever a platform does not offer is None, never guessed.

- **Raspberry Pi**: the firmware's throttle flags (``get_throttled``, a hex value like ``50005``: bit 0
  under-voltage now, 1 frequency capped, 2 throttled, 3 soft temperature limit; bits 16-19 the same since boot),
  and the under-voltage alarm of the ``rpi_volt`` hwmon (``in0_lcrit_alarm``).
- **Linux**: the hottest CPU thermal zone (``/sys/class/thermal/thermal_zone*/temp``, millidegrees; a Pi's is
  ``cpu-thermal``), the CPU's clock (``scaling_cur_freq`` against ``cpuinfo_max_freq``, kHz), power supplies
  (``/sys/class/power_supply/*``: a battery's capacity and status, a mains or USB supply's ``online``), pressure
  stall information (``/proc/pressure/memory`` and ``cpu``: the share of the last 10 s that some or all tasks
  waited), swap in use.
- **macOS**: thermal pressure (``com.apple.system.thermalpressurelevel``: nominal, moderate, heavy, trapping,
  sleeping), the power source, battery level and Low Power Mode (``pmset -g batt``, ``pmset -g``), memory
  pressure (``kern.memorystatus_vm_pressure_level``: 1 normal, 2 warn, 4 critical) and swap in use
  (``vm.swapusage``). macOS gives no CPU temperature or clock without root: None.
- **Everywhere**: whether the wall clock is synchronised (``nodeagent.clock.wall_synced``, injected), and the
  model folder's storage (``storage.py``) when asked.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable, Literal

from pydantic import Field

from nodeagent.hardware.system import SystemSource
from nodeagent.hardware.types import Storage
from nodeagent.values import Frozen

ThermalPressure = Literal["nominal", "moderate", "heavy", "trapping", "sleeping"]
MemoryPressure = Literal["normal", "warn", "critical"]
THERMAL_LEVELS: tuple[ThermalPressure, ...] = ("nominal", "moderate", "heavy", "trapping", "sleeping")
MEMORY_LEVELS: dict[int, MemoryPressure] = {1: "normal", 2: "warn", 4: "critical"}
PI_FLAGS = ("under-voltage", "frequency capped", "throttled", "soft temperature limit")
THROTTLE_FILES = ("/sys/devices/platform/soc/soc:firmware/get_throttled",
                  "/sys/devices/platform/soc*/*firmware*/get_throttled")  # the second: a Pi 5's
THERMAL_NOTIFY = "com.apple.system.thermalpressurelevel"
CPU_ZONES = ("cpu", "x86_pkg", "soc", "pkg", "core", "tctl", "tdie")  # thermal zone types that are the CPU's


class PiThrottle(Frozen):
    """A Raspberry Pi firmware's throttle flags (``get_throttled``)."""

    raw: str = Field(description="As the firmware gives it, e.g. 0x50005")
    now: list[str] = Field(description="Set now: under-voltage, frequency capped, throttled, soft temperature "
                                       "limit")
    since_boot: list[str] = Field(description="Set at some time since boot (bits 16-19)")

    @classmethod
    def decode(cls, value: int) -> "PiThrottle":
        return cls(raw=f"0x{value:x}", now=[f for i, f in enumerate(PI_FLAGS) if value >> i & 1],
                   since_boot=[f for i, f in enumerate(PI_FLAGS) if value >> (16 + i) & 1])


class Health(Frozen):
    temperature_c: float | None = Field(None, description="The hottest CPU thermal zone (Linux)")
    temperature_sensor: str | None = Field(None, description="Which zone, e.g. 'thermal_zone0 cpu-thermal'")
    cpu_freq_mhz: float | None = Field(None, description="cpu0's clock now (Linux)")
    cpu_freq_max_mhz: float | None = Field(None, description="cpu0's highest clock (Linux)")
    pi_throttle: PiThrottle | None = Field(None, description="A Raspberry Pi firmware's throttle flags")
    undervolt_alarm: bool | None = Field(None, description="The rpi_volt hwmon's under-voltage alarm (Pi)")
    thermal_pressure: ThermalPressure | None = Field(None, description="macOS thermal pressure")
    power_source: Literal["mains", "battery"] | None = Field(None, description="None: no power supply reported "
                                                                               "(a Pi, most desktops)")
    battery_pct: float | None = None
    battery_status: str | None = Field(None, description="charging, discharging, full, ...")
    low_power_mode: bool | None = Field(None, description="macOS Low Power Mode")
    memory_pressure: MemoryPressure | None = Field(None, description="macOS memory pressure (Linux: see psi_*)")
    swap_used_bytes: int | None = None
    psi_memory_some_avg10: float | None = Field(None, description="% of the last 10 s some task waited for memory")
    psi_memory_full_avg10: float | None = Field(None, description="% of the last 10 s every task waited for memory")
    psi_cpu_some_avg10: float | None = Field(None, description="% of the last 10 s some task waited for a CPU")
    psi_cpu_full_avg10: float | None = None
    clock_synced: bool | None = Field(None, description="The kernel says the wall clock is synchronised (NTP)")
    storage: Storage | None = Field(None, description="The model folder's device, kind and measured read speed")

    @property
    def cpu_freq_ratio(self) -> float | None:
        """The CPU's clock now over its maximum (an idle governor lowers it too: see the guard)."""
        if not self.cpu_freq_mhz or not self.cpu_freq_max_mhz:
            return None
        return min(1.0, self.cpu_freq_mhz / self.cpu_freq_max_mhz)

    @property
    def undervolted(self) -> bool:
        """Under-voltage now: the firmware's flag or the rpi_volt alarm."""
        return bool(self.pi_throttle and "under-voltage" in self.pi_throttle.now) or bool(self.undervolt_alarm)

    @property
    def on_battery(self) -> bool:
        return self.power_source == "battery"

    @property
    def throttling(self) -> list[str] | None:
        """What throttles the CPU now: a Pi's flags (but under-voltage, which is power's), macOS thermal pressure
        above nominal; None where neither is read."""
        if self.pi_throttle is None and self.thermal_pressure is None:
            return None
        out = [f for f in (self.pi_throttle.now if self.pi_throttle else []) if f != "under-voltage"]
        return out + ([f"thermal pressure {self.thermal_pressure}"] if self.thermal_pressure not in (None, "nominal")
                      else [])


def memory_level(h: Health, psi_some_pct: float, psi_full_pct: float) -> MemoryPressure | None:
    """normal, warn or critical: macOS's level, or on Linux from pressure stall information (memory ``full
    avg10`` at ``psi_full_pct`` is critical, ``some avg10`` at ``psi_some_pct`` warn); None where neither is
    read."""
    if h.memory_pressure is not None:
        return h.memory_pressure
    if h.psi_memory_full_avg10 is not None and h.psi_memory_full_avg10 >= psi_full_pct:
        return "critical"
    if h.psi_memory_some_avg10 is not None and h.psi_memory_some_avg10 >= psi_some_pct:
        return "warn"
    return "normal" if h.psi_memory_some_avg10 is not None else None


def _float(text: str | None) -> float | None:
    try:
        return float(text.strip()) if text is not None else None
    except ValueError:
        return None


def _temperature(sys: SystemSource) -> tuple[float | None, str | None]:
    """The hottest CPU zone (any zone where none is the CPU's), in degrees Celsius."""
    zones = []
    for path in sys.glob("/sys/class/thermal/thermal_zone*/temp"):
        base = path.rsplit("/", 1)[0]
        milli = _float(sys.read_text(path))
        if milli is None or not -40_000 < milli < 150_000:  # a sensor that reads nonsense is no reading
            continue
        kind = (sys.read_text(base + "/type") or "").strip()
        zones.append((milli / 1000, f"{base.rsplit('/', 1)[-1]} {kind}".strip(),
                      any(z in kind.lower() for z in CPU_ZONES)))
    chosen = [z for z in zones if z[2]] or zones
    if not chosen:
        return None, None
    c, name, _ = max(chosen)
    return round(c, 1), name


def _pi_throttle(sys: SystemSource) -> PiThrottle | None:
    for pattern in THROTTLE_FILES:
        for path in ([pattern] if "*" not in pattern else sys.glob(pattern)):
            text = (sys.read_text(path) or "").strip().lower()
            if text:
                try:
                    return PiThrottle.decode(int(text.removeprefix("throttled=").removeprefix("0x"), 16))
                except ValueError:
                    return None
    return None


def _undervolt_alarm(sys: SystemSource) -> bool | None:
    for path in sys.glob("/sys/class/hwmon/hwmon*/name"):
        if (sys.read_text(path) or "").strip() == "rpi_volt":
            value = (sys.read_text(path.rsplit("/", 1)[0] + "/in0_lcrit_alarm") or "").strip()
            return {"0": False, "1": True}.get(value)
    return None


def _cpu_freq(sys: SystemSource) -> tuple[float | None, float | None]:
    base = "/sys/devices/system/cpu/cpu0/cpufreq/"
    cur, top = _float(sys.read_text(base + "scaling_cur_freq")), _float(sys.read_text(base + "cpuinfo_max_freq"))
    return (round(cur / 1000, 1) if cur else None), (round(top / 1000, 1) if top else None)


def _linux_power(sys: SystemSource) -> tuple[str | None, float | None, str | None]:
    """(power source, battery %, battery status) from /sys/class/power_supply: on mains when a mains or USB
    supply is online, or a battery charges or is full; on battery when one discharges with none online."""
    online, batteries = False, []
    for path in sys.glob("/sys/class/power_supply/*/type"):
        base = path.rsplit("/", 1)[0]
        kind = (sys.read_text(path) or "").strip()
        if kind == "Battery":
            if (sys.read_text(base + "/scope") or "").strip() == "Device":
                continue  # a mouse's or a keyboard's battery
            batteries.append((_float(sys.read_text(base + "/capacity")),
                              (sys.read_text(base + "/status") or "").strip().lower() or None))
        elif (sys.read_text(base + "/online") or "").strip() == "1":
            online = True
    if not batteries:
        return ("mains" if online else None), None, None
    pct, status = batteries[0]
    discharging = any(s == "discharging" for _, s in batteries)
    return ("battery" if discharging and not online else "mains"), pct, status


def _psi(sys: SystemSource, resource: str) -> tuple[float | None, float | None]:
    """(some avg10, full avg10) of /proc/pressure/<resource>."""
    found: dict[str, float] = {}
    for line in (sys.read_text(f"/proc/pressure/{resource}") or "").splitlines():
        kind, _, rest = line.partition(" ")
        m = re.search(r"avg10=([\d.]+)", rest)
        if m:
            found[kind] = float(m.group(1))
    return found.get("some"), found.get("full")


def _linux_swap(sys: SystemSource) -> int | None:
    fields = {}
    for line in (sys.read_text("/proc/meminfo") or "").splitlines():
        key, _, value = line.partition(":")
        if key in ("SwapTotal", "SwapFree"):
            fields[key] = int(value.split()[0]) * 1024
    return fields["SwapTotal"] - fields["SwapFree"] if len(fields) == 2 else None


_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def _darwin_swap(text: str | None) -> int | None:
    """``total = 2048.00M  used = 1024.25M  free = 1023.75M  (encrypted)`` -> the bytes used."""
    m = re.search(r"used = ([\d.]+)([KMGT])", text or "")
    return int(float(m.group(1)) * _UNITS[m.group(2)]) if m else None


def _pmset(sys: SystemSource) -> tuple[str | None, float | None, str | None, bool | None]:
    """(power source, battery %, status, Low Power Mode) from ``pmset -g batt`` and ``pmset -g``."""
    batt = sys.command(["pmset", "-g", "batt"]) or ""
    m = re.search(r"Now drawing from '([^']+)'", batt)
    source = None if m is None else ("battery" if "Battery" in m.group(1) else "mains")
    m = re.search(r"(\d+)%;\s*([^;]+);", batt)
    pct, status = (float(m.group(1)), m.group(2).strip().lower()) if m else (None, None)
    settings = sys.command(["pmset", "-g"]) or ""
    m = re.search(r"^\s*lowpowermode\s+(\d)", settings, re.MULTILINE)
    return source, pct, status, (m.group(1) == "1") if m else None


def read_health(sys: SystemSource, synced: Callable[[], bool | None] | None = None,
                storage: Callable[[], Storage | None] | None = None) -> Health:
    """One reading. ``synced``: whether the wall clock is synchronised (``clock.wall_synced`` on this machine, the
    fixture's fact on a recorded one); ``storage``: the model folder's storage, when wanted (``storage.py``)."""
    fields: dict[str, object] = {}
    os_name = sys.system()
    if os_name == "linux":
        fields["temperature_c"], fields["temperature_sensor"] = _temperature(sys)
        fields["cpu_freq_mhz"], fields["cpu_freq_max_mhz"] = _cpu_freq(sys)
        fields["pi_throttle"] = _pi_throttle(sys)
        fields["undervolt_alarm"] = _undervolt_alarm(sys)
        fields["power_source"], fields["battery_pct"], fields["battery_status"] = _linux_power(sys)
        fields["psi_memory_some_avg10"], fields["psi_memory_full_avg10"] = _psi(sys, "memory")
        fields["psi_cpu_some_avg10"], fields["psi_cpu_full_avg10"] = _psi(sys, "cpu")
        fields["swap_used_bytes"] = _linux_swap(sys)
    elif os_name == "darwin":
        level = sys.notify_state(THERMAL_NOTIFY)
        fields["thermal_pressure"] = THERMAL_LEVELS[level] if level is not None and 0 <= level < 5 else None
        (fields["power_source"], fields["battery_pct"], fields["battery_status"],
         fields["low_power_mode"]) = _pmset(sys)
        pressure = _float(sys.sysctl("kern.memorystatus_vm_pressure_level"))
        fields["memory_pressure"] = MEMORY_LEVELS.get(int(pressure)) if pressure is not None else None
        fields["swap_used_bytes"] = _darwin_swap(sys.sysctl("vm.swapusage"))
    fields["clock_synced"] = synced() if synced else None
    fields["storage"] = storage() if storage else None
    return Health(**fields)


class HealthReader:
    """Readings of one machine: ``read()`` for the guard (no storage: it never changes), ``full()`` for the
    probe (with the model folder's storage, measured now when ``measure`` and not measured before)."""

    def __init__(self, system: SystemSource, synced: Callable[[], bool | None] | None = None,
                 folder: str | None = None, state_dir: Path | None = None) -> None:
        self.system, self.synced, self.folder, self.state_dir = system, synced, folder, state_dir

    def read(self) -> Health:
        return read_health(self.system, self.synced)

    def storage(self, measure: bool = False) -> Storage | None:
        from nodeagent.hardware.storage import storage_info

        return None if self.folder is None else storage_info(self.system, self.folder, self.state_dir, measure)

    def full(self, measure: bool = False) -> Health:
        return read_health(self.system, self.synced, lambda: self.storage(measure))


def reader_for(fixture: Path | None, folder: str | None = None, state_dir: Path | None = None) -> HealthReader:
    """This machine's reader, or a recorded machine's (``NODEAGENT_HARDWARE_FIXTURE``), whose clock sync is the
    fixture's fact ``clock_synced``."""
    from nodeagent.hardware.system import LiveSystem, RecordedSystem

    if fixture:
        recorded = RecordedSystem.load(fixture)
        return HealthReader(recorded, lambda: recorded.facts.get("clock_synced"), folder, state_dir)
    from nodeagent.clock import wall_synced

    return HealthReader(LiveSystem(), wall_synced, folder, state_dir)
