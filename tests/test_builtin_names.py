"""Names that work from any directory without a download: the shipped draft, Medusa and LoRA
checkpoints (the top-level `checkpoints/`, installed as the package `jinfer.checkpoints`) and `tiny-random-moe`, a random Mixtral written to the
cache on first use, the same files everywhere."""
from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import sys
import tomllib

import pytest

from jinfer import LLM, SamplingParams
from jinfer.engine.speculative.config import SpeculativeConfig
from jinfer.errors import ParameterError
from jinfer.loader import load_model
from jinfer.weights.builtin import (CHECKPOINTS_DIR, SHIPPED_ADAPTERS, SHIPPED_CHECKPOINTS,
                                    adapter_path, checkpoint_path, known_names, random_model_dir,
                                    resolve_speculative_model)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _setuptools() -> dict:
  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as fh:
    return tomllib.load(fh)["tool"]["setuptools"]


def test_every_checkpoint_file_is_package_data():
  assert CHECKPOINTS_DIR == os.path.join(ROOT, "checkpoints")
  tool = _setuptools()
  assert tool["package-dir"] == {"jinfer.checkpoints": "checkpoints"}
  patterns = tool["package-data"]["jinfer.checkpoints"]
  files = [os.path.relpath(os.path.join(d, f), CHECKPOINTS_DIR)
           for d, _, fs in os.walk(CHECKPOINTS_DIR) for f in fs if "__pycache__" not in d]
  # setuptools' globs: `*` stops at "/", `**` crosses it
  def shipped(path):
    return any(fnmatch.fnmatch(path, p.replace("**/*", "*")) if "**" in p
               else fnmatch.fnmatch(path, p) and path.count("/") == p.count("/")
               for p in patterns)
  assert len(files) > 20 and [f for f in files if not shipped(f)] == []


def test_the_package_list_covers_every_package():
  """pyproject lists the packages (it maps `checkpoints/` into jinfer): a new one must be there."""
  found = {os.path.relpath(d, ROOT).replace(os.sep, ".")
           for top in ("jinfer", "pallas_kernels")
           for d, _, fs in os.walk(os.path.join(ROOT, top))
           if "__pycache__" not in d and any(f.endswith((".py", ".json", ".txt", ".txtpb"))
                                             for f in fs)}
  assert set(_setuptools()["packages"]) == found | {"jinfer.checkpoints"}


@pytest.mark.parametrize("name", SHIPPED_ADAPTERS)
def test_shipped_adapters_resolve_by_name_and_load(name, tmp_path, monkeypatch):
  from jinfer.weights.peft_adapter import load_peft_adapter
  monkeypatch.chdir(tmp_path)
  assert name in known_names()
  config, _, _ = load_model("smollm2-135m-instruct", config_only=True)
  adapter = load_peft_adapter(adapter_path(name), config, max_rank=8)
  assert adapter.rank == 8 and adapter.target_modules == ("k_proj", "o_proj", "q_proj", "v_proj")
  assert adapter.num_bytes() < 8 << 20
  with pytest.raises(ValueError, match="unknown LoRA adapter 'nope'; shipped adapters: "):
    adapter_path("nope")


@pytest.mark.parametrize("name, meta", [("smollm2-135m-draft", "draft.json"),
                                        ("smollm2-135m-medusa", "medusa.json")])
def test_shipped_checkpoints_resolve_by_name_from_any_directory(name, meta, tmp_path,
                                                                monkeypatch):
  monkeypatch.chdir(tmp_path)
  method = "draft_model" if "draft" in name else "medusa"
  spec = {"method": method, "model": name, "num_speculative_tokens": 2}
  path = resolve_speculative_model(spec)["model"]
  assert path == checkpoint_path(name) and os.path.isfile(os.path.join(path, meta))
  # JSON text (the CLI's) and a config object resolve alike; the engine's config accepts them
  assert json.loads(resolve_speculative_model(json.dumps(spec)))["model"] == path
  assert resolve_speculative_model(SpeculativeConfig.parse(spec)).model == path
  assert SpeculativeConfig.parse(resolve_speculative_model(spec)).resolve("cpu").model == path


def test_a_speculative_model_that_is_not_there_is_not_found(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  spec = {"method": "draft_model", "model": "checkpoints/smollm2-135m-draft",
          "num_speculative_tokens": 2}
  with pytest.raises(ParameterError, match=r"model 'checkpoints/smollm2-135m-draft' not found: "
                     r"no such file or directory .*known: " + ", ".join(known_names())) as e:
    resolve_speculative_model(spec)
  assert e.value.param == "speculative_config"
  assert set(SHIPPED_CHECKPOINTS) | {"tiny-random-moe", "smollm2-135m-instruct"} <= set(
      known_names())
  # ngram has no model, and paths and built-in model names pass unchanged
  for s in ({"method": "ngram", "num_speculative_tokens": 2},
            {**spec, "model": str(tmp_path)}, {**spec, "model": "smollm2-135m-instruct"}):
    assert resolve_speculative_model(s) == s


def test_llm_says_not_found_before_loading_anything(tmp_path):
  spec = {"method": "medusa", "model": str(tmp_path / "heads"), "num_speculative_tokens": 2}
  with pytest.raises(ParameterError, match="not found"):
    LLM(str(tmp_path / "no-model"), speculative_config=spec)  # the model would fail later


def _tree_sha(path: str) -> dict[str, str]:
  out = {}
  for f in sorted(os.listdir(path)):
    with open(os.path.join(path, f), "rb") as fh:
      out[f] = hashlib.sha256(fh.read()).hexdigest()
  return out


def test_tiny_random_moe_is_the_same_files_everywhere(tmp_path, monkeypatch):
  dirs = []
  for sub in ("a", "b"):
    monkeypatch.setenv("JINFER_CACHE_DIR", str(tmp_path / sub))
    dirs.append(random_model_dir("tiny-random-moe"))
  assert dirs[0] != dirs[1] and _tree_sha(dirs[0]) == _tree_sha(dirs[1])
  assert set(os.listdir(dirs[0])) == {"config.json", "model.safetensors", "tokenizer.json",
                                      "tokenizer_config.json"}
  assert [f for f in os.listdir(tmp_path / "a" / "models") if f.startswith(".")] == []
  config, _, tok = load_model("tiny-random-moe", config_only=True)
  assert (config.architecture, config.num_experts, config.num_experts_per_tok) == ("mixtral", 8, 2)
  text = "Mixture of experts, ünïcode ✓"
  assert tok.decode(tok.encode(text)) == text
  assert tok.eos_token_ids == config.eos_token_ids == (tok.encode("<|im_end|>")[-1],)
  prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
  assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.slow  # an MoE engine, ~5 s; quick: test_tiny_random_moe_is_the_same_files_everywhere
def test_tiny_random_moe_runs_by_name(tmp_path, monkeypatch):
  monkeypatch.setenv("JINFER_CACHE_DIR", str(tmp_path))
  llm = LLM("tiny-random-moe", warmup=False, max_model_len=64, max_num_seqs=2,
            max_num_batched_tokens=16)
  outs = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=6, seed=0),
                  use_tqdm=False)
  assert len(outs[0].outputs[0].token_ids) == 6
  assert llm.engine.stats().expert_load is not None


def test_long_context_bench_without_matplotlib_fails_before_its_work(monkeypatch):
  from jinfer.bench import long_context
  monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
  # a model that does not exist: the plot's check comes first, so that is not what fails
  with pytest.raises(SystemExit, match=r'pip install "jinfer\[plot\]".*--plot \'\''):
    long_context.main(["--model", "no-such-model", "--plot", "out.png", "--devices", "1"])


@pytest.mark.slow  # builds the wheel (~10 s)
def test_an_installed_wheel_resolves_the_shipped_names(tmp_path):
  """The wheel carries `checkpoints/` as `jinfer.checkpoints`: unpacked away from the checkout,
  its built-in names point inside it, at files that are there."""
  import subprocess
  import sys
  import zipfile
  subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w",
                  str(tmp_path / "dist"), ROOT], check=True, capture_output=True)
  (wheel,) = (tmp_path / "dist").glob("jinfer-*.whl")
  zipfile.ZipFile(wheel).extractall(tmp_path / "site")
  code = ("import os, jinfer.weights.builtin as b; "
          "print(b.CHECKPOINTS_DIR); "
          "print(all(os.path.isfile(os.path.join(b.adapter_path(n), 'adapter_model.safetensors')) "
          "for n in b.SHIPPED_ADAPTERS) and all(os.path.isfile(os.path.join(b.checkpoint_path(n), "
          "'README.md')) for n in b.SHIPPED_CHECKPOINTS))")
  out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                       text=True, env=dict(os.environ, PYTHONPATH=str(tmp_path / "site")),
                       check=True).stdout.split()
  assert out == [str(tmp_path / "site" / "jinfer" / "checkpoints"), "True"]
