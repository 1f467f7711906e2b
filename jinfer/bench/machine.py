"""What a benchmark ran on, so its numbers can be read later."""
from __future__ import annotations

import os
import platform

import jax


def _cpu_model() -> str:
  # platform.processor() is empty on most Linux systems; /proc/cpuinfo has the marketing name.
  try:
    with open("/proc/cpuinfo") as fh:
      for line in fh:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def machine_info() -> dict:
  """CPU, cores, jax version and backend, and the load at start: the CPU may be shared."""
  dev = jax.devices()[0]
  info = {
      "cpu_model": _cpu_model(),
      "cpu_count": os.cpu_count(),
      "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
      "platform": platform.platform(),
      "python": platform.python_version(),
      "jax_version": jax.__version__,
      "backend": jax.default_backend(),
      "device_kind": dev.device_kind,
      "num_devices": jax.device_count(),
  }
  if hasattr(os, "getloadavg"):
    info["load_avg_1m_at_start"] = round(os.getloadavg()[0], 2)
  return info
