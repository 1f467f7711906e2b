"""The hardware jinfer claims, as compile-only devices: TPU slices and NVIDIA GPUs this machine
need not have.

Each `Target` names a chip and a device count with the published figures a plan divides by
(HBM per device, its bandwidth, dense bf16 throughput; sources in docs/compile-only.md), and
`devices()` gives its devices from the real compiler's topology description: libtpu for TPU
slices (`pip install 'jinfer[compile-tpu]'`), jax's CUDA plugin with ptxas for GPUs
(`'jinfer[compile-gpu]'`, whose target descriptions are the `.txtpb` files beside this module,
from XLA's GPU specs). `jax.jit(f).lower(ShapeDtypeStruct(..., sharding=...)).compile()` over
them runs XLA:TPU and Mosaic, or XLA:GPU and Triton, and allocates nothing.

Nothing here runs at import: jax's CPU start stays as it is for users who never plan, and the
compilers load only when a target's devices are first asked for.
"""
from __future__ import annotations

import dataclasses
import functools
import os

from jinfer.errors import ParameterError

_HERE = os.path.dirname(os.path.abspath(__file__))
GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Target:
  name: str  # what `--target` takes
  chip: str
  platform: str  # "tpu" or "gpu": the engine's platform, which picks its kernels and dtype
  num_devices: int
  hbm_bytes: int  # per device
  hbm_bandwidth: float  # bytes/s per device
  bf16_flops: float  # dense, per device
  topology: str  # the compiler's topology name
  spec: str | None = None  # GPU: the target description file beside this module

  def devices(self) -> list:
    """The target's compile-only devices, in the topology's order."""
    return list(_topology(self.name).devices)


def _tpu(name, chip, n, topology, hbm_gib, bandwidth, flops):
  return Target(name, chip, "tpu", n, hbm_gib * GiB, bandwidth, flops, topology)


def _gpu(name, chip, n, spec, hbm_bytes, bandwidth, flops):
  return Target(name, chip, "gpu", n, hbm_bytes, bandwidth, flops, f"1x1x{n}", spec)


_V5E = dict(chip="TPU v5e", hbm_gib=16, bandwidth=819e9, flops=197e12)
_V6E = dict(chip="TPU v6e", hbm_gib=32, bandwidth=1640e9, flops=918e12)
_H100 = dict(chip="NVIDIA H100 SXM", spec="h100_sxm.txtpb", hbm_bytes=80 * 10**9,
             bandwidth=3.35e12, flops=989e12)
_H200 = dict(chip="NVIDIA H200 SXM", spec="h200_sxm.txtpb", hbm_bytes=141 * 10**9,
             bandwidth=4.8e12, flops=989e12)

TARGETS: dict[str, Target] = {t.name: t for t in [
    _tpu("v5e-1", n=1, topology="v5e:1x1", **_V5E),
    _tpu("v5e-4", n=4, topology="v5e:2x2", **_V5E),
    _tpu("v5e-8", n=8, topology="v5e:2x4", **_V5E),
    _tpu("v6e-1", n=1, topology="v6e:1x1", **_V6E),
    _tpu("v6e-4", n=4, topology="v6e:2x2", **_V6E),
    _tpu("v6e-8", n=8, topology="v6e:2x4", **_V6E),
    _gpu("h100", n=1, **_H100),
    _gpu("h100-8", n=8, **_H100),
    _gpu("h200", n=1, **_H200),
    _gpu("h200-8", n=8, **_H200),
]}

EXTRAS = {"tpu": "compile-tpu", "gpu": "compile-gpu"}


class CompilerMissing(RuntimeError):
  """The compiler a target needs is not installed; the message names the extra."""


def target(name: str) -> Target:
  if name not in TARGETS:
    raise ParameterError("target", f"unknown target {name!r}; known targets: "
                                   f"{', '.join(TARGETS)}")
  return TARGETS[name]


def _missing(t: Target, why: str) -> CompilerMissing:
  return CompilerMissing(f"compiling for {t.name} ({t.chip}) needs the {t.platform.upper()} "
                         f"compiler: pip install 'jinfer[{EXTRAS[t.platform]}]' ({why})")


@functools.cache
def _topology(name: str):
  from jax.experimental import topologies
  t = target(name)
  if t.platform == "tpu":
    try:
      import libtpu  # noqa: F401  (the compiler; imported only to say which extra is missing)
    except ImportError:
      raise _missing(t, "libtpu is not installed") from None
    # Compile-only devices touch no chip, so the lock that keeps two processes off one TPU
    # host's chips does not apply (parallel test workers each load libtpu); and off a TPU VM
    # libtpu warns that it cannot find the VM's workers unless told there is this one.
    for var, value in (("ALLOW_MULTIPLE_LIBTPU_LOAD", "1"), ("TPU_WORKER_HOSTNAMES", "localhost"),
                       ("TPU_ACCELERATOR_TYPE", t.topology.replace(":", "-"))):
      os.environ.setdefault(var, value)
    # The whole slice on one host (process 0), as a v*e-1/4/8 VM has it.
    x, y = (int(n) for n in t.topology.split(":")[1].split("x"))
    return topologies.get_topology_desc(topology_name=t.topology, platform="tpu",
                                        chips_per_host_bounds=(x, y, 1))
  try:
    import jax_plugins.xla_cuda12  # noqa: F401
  except ImportError:
    raise _missing(t, "jax's CUDA plugin is not installed") from None
  with open(os.path.join(_HERE, t.spec)) as f:
    spec = f.read()
  return topologies.get_topology_desc(platform="cuda", target_config=spec, topology=t.topology)
