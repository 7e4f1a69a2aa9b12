"""The GPU as the driver describes it, without creating a CUDA context: NVML through
``pynvml`` when it is importable, else ``nvidia-smi``'s query options.

Also :func:`kind_from_name`, the short device kind iadeep uses (``h100``).
"""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from typing import Dict, List, Optional, Tuple

MIB = 1024 * 1024


def kind_from_name(name: str) -> str:
    """A short kind from a marketing name: "NVIDIA H100 80GB HBM3" -> "h100".

    The same rule as ``kind_from_name`` in tuner/src/daemon/device.rs, which names the
    device kind of ``iadeep up`` and ``iadeep tuner``, so measured files and a live
    cluster agree on the kind.
    """
    generic = {"nvidia", "tesla", "geforce", "quadro", "rtx"}
    for word in name.split():
        lower = word.lower()
        if lower not in generic and any(c.isdigit() for c in lower):
            return lower
    return name.lower().replace(" ", "-")


class GpuProbe:
    """Reads one GPU through NVML (pynvml) or nvidia-smi; see :meth:`open`."""

    def __init__(self, index: int, nvml: object = None) -> None:
        self.index = index
        self._nvml = nvml
        self._handle = nvml.nvmlDeviceGetHandleByIndex(index) if nvml is not None else None  # type: ignore[attr-defined]
        self.source = "pynvml" if nvml is not None else "nvidia-smi"

    @classmethod
    def open(cls, index: int = 0) -> Optional["GpuProbe"]:
        """The probe of GPU `index`, or None when neither pynvml nor nvidia-smi works."""
        try:
            import pynvml  # type: ignore[import-not-found]

            pynvml.nvmlInit()
            return cls(index, pynvml)
        except Exception:  # noqa: BLE001 - any failure means "no NVML here"
            pass
        if shutil.which("nvidia-smi") is None:
            return None
        probe = cls(index)
        try:
            probe.info()
        except (OSError, RuntimeError, ValueError, subprocess.SubprocessError):
            return None
        return probe

    def _smi(self, *args: str) -> List[List[str]]:
        out = subprocess.run(
            ["nvidia-smi", *args, "--format=csv,noheader,nounits", "-i", str(self.index)],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout
        return [[field.strip() for field in line.split(",")] for line in out.splitlines() if line.strip()]

    @staticmethod
    def _text(value: object) -> str:
        return value.decode() if isinstance(value, bytes) else str(value)

    def info(self) -> Dict[str, object]:
        """Name, driver version, total memory (MiB), UUID and where they came from."""
        if self._nvml is not None:
            n = self._nvml
            memory = n.nvmlDeviceGetMemoryInfo(self._handle)  # type: ignore[attr-defined]
            info: Dict[str, object] = {
                "name": self._text(n.nvmlDeviceGetName(self._handle)),  # type: ignore[attr-defined]
                "driver_version": self._text(n.nvmlSystemGetDriverVersion()),  # type: ignore[attr-defined]
                "memory_total_mib": memory.total // MIB,
                "uuid": self._text(n.nvmlDeviceGetUUID(self._handle)),  # type: ignore[attr-defined]
            }
        else:
            rows = self._smi("--query-gpu=name,driver_version,memory.total,uuid")
            if not rows or len(rows[0]) != 4:
                raise RuntimeError(f"nvidia-smi: unexpected answer {rows}")
            name, driver, total, uuid = rows[0]
            info = {"name": name, "driver_version": driver, "memory_total_mib": int(float(total)), "uuid": uuid}
        info["kind"] = kind_from_name(str(info["name"]))
        info["source"] = self.source
        return info

    def used_mib(self) -> float:
        """Memory in use on the whole GPU, MiB."""
        if self._nvml is not None:
            return self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used / MIB  # type: ignore[attr-defined]
        return float(self._smi("--query-gpu=memory.used")[0][0])

    def process_used_mib(self, pid: int) -> Optional[float]:
        """Memory NVML charges to process `pid`, MiB; None when NVML does not list it
        (in a container with its own PID namespace NVML shows the host's PIDs)."""
        if self._nvml is not None:
            for process in self._nvml.nvmlDeviceGetComputeRunningProcesses(self._handle):  # type: ignore[attr-defined]
                if process.pid == pid and process.usedGpuMemory is not None:
                    return process.usedGpuMemory / MIB
            return None
        try:
            rows = self._smi("--query-compute-apps=pid,used_memory")
        except (OSError, subprocess.SubprocessError):
            return None
        for row in rows:
            if len(row) == 2 and row[0] == str(pid):
                try:
                    return float(row[1])
                except ValueError:
                    return None
        return None

    def utilization(self) -> Optional[Tuple[float, float]]:
        """(SM busy %, memory-bandwidth busy %) over the driver's last sample period."""
        try:
            if self._nvml is not None:
                rates = self._nvml.nvmlDeviceGetUtilizationRates(self._handle)  # type: ignore[attr-defined]
                return float(rates.gpu), float(rates.memory)
            row = self._smi("--query-gpu=utilization.gpu,utilization.memory")[0]
            return float(row[0]), float(row[1])
        except Exception:  # noqa: BLE001 - a missed sample is skipped, not fatal
            return None


class UtilSampler:
    """Samples a GPU's utilisation on a thread while a measurement window runs."""

    def __init__(self, probe: Optional[GpuProbe], interval_s: float = 0.2) -> None:
        self.probe = probe
        self.interval_s = interval_s
        self.samples: List[Tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self, from_time: float) -> "UtilSampler":
        """Starts sampling at wall-clock time `from_time` (time.time())."""
        if self.probe is None:
            return self

        def loop() -> None:
            while not self._stop.is_set():
                if time.time() >= from_time:
                    sample = self.probe.utilization()  # type: ignore[union-attr]
                    if sample is not None:
                        self.samples.append(sample)
                self._stop.wait(self.interval_s)

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> Optional[Dict[str, float]]:
        """Mean SM and memory utilisation over the samples, or None without any."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if not self.samples:
            return None
        n = len(self.samples)
        return {
            "gpu_util": sum(s[0] for s in self.samples) / n,
            "mem_util": sum(s[1] for s in self.samples) / n,
            "util_samples": float(n),
        }
