"""Weights sent from a trainer in another process (`jinfer.engine.weight_transfer`): the
trainer side of `jinfer.bench.weight_transfer` sends a params tree over JAX's transfer API on
loopback; it arrives bit for bit, and the engine runs the arrays as they arrived."""
from __future__ import annotations

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from jinfer.bench.weight_transfer import random_params
from jinfer.engine.engine import LLMEngine
from jinfer.engine.weight_transfer import WeightReceiver


@pytest.mark.slow  # a second process, which imports jax and jinfer
def test_weights_from_another_process_arrive_whole_and_run_without_a_copy(tiny_model_dir):
  rx = WeightReceiver()
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  trainer = subprocess.Popen(
      [sys.executable, "-m", "jinfer.bench.weight_transfer", "--model", tiny_model_dir,
       "--repeats", "0", "--trainer", rx.address, rx.key.hex()],
      env=dict(os.environ, PYTHONPATH=root), stderr=subprocess.PIPE, text=True)
  try:
    got = rx.receive(timeout=120)
    assert trainer.wait(timeout=60) == 0, trainer.stderr.read()[-2000:]
  finally:
    trainer.kill()
    rx.close()
  want = random_params(tiny_model_dir)
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert a.devices() == {jax.devices()[0]}
    np.testing.assert_array_equal(a, b)
  engine = LLMEngine(tiny_model_dir, warmup=False)
  engine.update_weights(got)
  assert all(a is b for a, b in zip(jax.tree.leaves(engine.runner.stacked_params),
                                    jax.tree.leaves(got)))
