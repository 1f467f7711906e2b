"""Weights from a trainer process to an engine's process over JAX's transfer API
(`jinfer.engine.weight_transfer`) on loopback, against the file round trip it replaces: a full
params tree of `--model`'s shapes (random float32 values) sent `--repeats` times by a trainer
subprocess (once more first, untimed); each receive is timed from the call until the arrays are on this process's device.
The baseline writes the same tensors to a safetensors file and reads them back onto the device,
in this process (the page cache warm: a best case for the file). Prints JSON, medians.

    python -m jinfer.bench.weight_transfer --model smollm2-135m-instruct --repeats 5
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np

from jinfer.bench.machine import machine_info
from jinfer.bench.report import emit
from jinfer.engine.weight_transfer import WeightReceiver, WeightSender
from jinfer.loader import load_model
from jinfer.models import param_shapes


def random_params(model: str, seed: int = 0) -> dict:
  """A params tree of `model`'s shapes, random float32 numpy values."""
  config = load_model(model, config_only=True)[0]
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda s: rng.standard_normal(s.shape, np.float32), param_shapes(config))


def trainer(address: str, key: str, model: str, repeats: int) -> None:
  params = jax.device_put(random_params(model))
  tx = WeightSender(address, bytes.fromhex(key))
  for _ in range(repeats + 1):  # the first is the receiver's wait for this process to start
    tx.send(params)
  tx.close()


def file_round_trip(params: dict, folder: str) -> float:
  from safetensors.numpy import load_file, save_file
  flat = {jax.tree_util.keystr(p): np.asarray(a)
          for p, a in jax.tree_util.tree_flatten_with_path(params)[0]}
  path = os.path.join(folder, "weights.safetensors")
  t0 = time.perf_counter()
  save_file(flat, path)
  jax.block_until_ready(jax.device_put(load_file(path)))
  return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--model", default="smollm2-135m-instruct",
                  help="whose params' shapes are sent (its config only is read)")
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--out")
  ap.add_argument("--trainer", nargs=2, metavar=("ADDRESS", "KEY"), help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.trainer:
    trainer(*args.trainer, args.model, args.repeats)
    return {}
  machine = machine_info()
  rx = WeightReceiver()
  child = subprocess.Popen([sys.executable, "-m", "jinfer.bench.weight_transfer", "--model",
                            args.model, "--repeats", str(args.repeats), "--trainer", rx.address,
                            rx.key.hex()])
  seconds, received = [], None
  for _ in range(args.repeats + 1):
    t0 = time.perf_counter()
    received = rx.receive(timeout=600)
    seconds.append(time.perf_counter() - t0)
  child.wait()
  rx.close()
  timed = seconds[1:]  # the first waited for the trainer to start and build its params
  nbytes = sum(a.nbytes for a in jax.tree.leaves(received))
  with tempfile.TemporaryDirectory() as folder:
    files = [file_round_trip(received, folder) for _ in range(len(timed))]
  t, f = statistics.median(timed), statistics.median(files)
  report = {"machine": machine, "model": args.model, "bytes": nbytes,
            "transfer": {"median_s": t, "bytes_per_s": nbytes / t, "seconds": timed},
            "file_round_trip": {"median_s": f, "bytes_per_s": nbytes / f, "seconds": files},
            "transfer_speedup": f / t}
  emit(report, args.out)
  return report


if __name__ == "__main__":
  main()
