"""`jinfer serve` as a user starts it: the command in a subprocess, on a free loopback port."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.live_server import http

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_serve_logs_its_progress_and_address_and_answers_there(smollm2_gguf):
  with socket.create_server(("127.0.0.1", 0)) as s:
    port = s.getsockname()[1]
  proc = subprocess.Popen(
      [sys.executable, "-c", "from jinfer.cli import main; main()", "serve", "--model",
       smollm2_gguf, "--port", str(port), "--served-model-name", "smol", "--max-model-len", "128",
       "--max-num-seqs", "2", "--max-num-batched-tokens", "32"],
      cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    deadline = time.monotonic() + 600
    while True:
      assert proc.poll() is None, proc.communicate()[1][-4000:]
      assert time.monotonic() < deadline, "the server did not come up"
      try:
        status, _, body = http(f"http://127.0.0.1:{port}/v1/models", timeout=5)
        break
      except OSError:  # not listening yet, or bound but not serving yet
        time.sleep(1)
    assert status == 200 and b'"smol"' in body
  finally:
    proc.terminate()
    _, err = proc.communicate(timeout=120)
  # An imported library configures logging first (absl, through orbax): the server's own INFO
  # lines must still reach the user.
  assert "loading " in err, err[-4000:]
  assert f"serving smol on http://127.0.0.1:{port}/v1" in err, err[-4000:]
  assert "Unable to initialize backend" not in err  # other libraries' INFO lines stay quiet
  # A clean shutdown; uvicorn then re-raises the SIGTERM it caught, as its exit status.
  assert "Finished server process" in err, err[-4000:]
  assert proc.returncode in (0, -signal.SIGTERM), err[-4000:]
