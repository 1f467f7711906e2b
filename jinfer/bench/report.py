"""How every benchmark hands over its result: JSON on stdout, and in a file when asked."""
from __future__ import annotations

import json


def emit(report: dict, out: str | None = None) -> None:
  text = json.dumps(report, indent=2)
  print(text)
  if out:
    with open(out, "w") as fh:
      fh.write(text + "\n")
