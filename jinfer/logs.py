"""jinfer's progress lines on stderr: what it loads and compiles and how long that took, from the
Python API as from the command line (vLLM prints its own the same way).

Importing jinfer gives the "jinfer" logger a handler at INFO, unless the application gave that
logger a handler or a level first. `JINFER_LOGGING_LEVEL=WARNING` quiets it (any level name
works); `JINFER_CONFIGURE_LOGGING=0` leaves jinfer's logging to the application entirely.
"""
from __future__ import annotations

import logging
import os
import sys

FORMAT = "jinfer: %(message)s"


def configure(level: str | int | None = None, fmt: str = FORMAT) -> None:
  """Give the "jinfer" logger its stderr handler, at `level` (default: `JINFER_LOGGING_LEVEL`,
  else INFO), lines formatted by `fmt`. Without `level`, an application's own configuration is
  left as it is."""
  logger = logging.getLogger("jinfer")
  if level is None:
    if (os.environ.get("JINFER_CONFIGURE_LOGGING", "1") == "0" or logger.handlers
        or logger.level != logging.NOTSET):
      return
    level = os.environ.get("JINFER_LOGGING_LEVEL", "INFO").upper()
  if not logger.handlers:
    logger.addHandler(logging.StreamHandler(sys.stderr))
  for handler in logger.handlers:
    handler.setFormatter(logging.Formatter(fmt))
  logger.setLevel(level)
  logger.propagate = False  # a root handler (importing orbax installs one) would print it again
