"""Session fixtures: the real SmolLM2 GGUF, HF transformers' tokenizer and model built from it,
a tiny random model over its vocabulary, and a tinier model directory.

Built once per session: transformers' GGUF loading takes seconds to tens of seconds on 2 cores.
"""
from __future__ import annotations

import os

import pytest

# Nothing may reach a model hub; set before any test module imports transformers.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import jax  # noqa: E402

# Eight CPU devices for the sharding tests (before anything initializes the backend); every
# other test runs on the first, as on one device.
jax.config.update("jax_num_cpu_devices", 8)


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
  from jinfer.weights.builtin import builtin_gguf_path
  return builtin_gguf_path("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, smollm2_gguf):
  """(config, params, tokenizer) of a 2-layer random Llama with SmolLM2's tokenizer."""
  from tests.engine_fixtures import tiny_loaded
  return tiny_loaded(str(tmp_path_factory.mktemp("tiny")), smollm2_gguf)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
  """An HF directory of a one-layer random Llama over 128 word-level tokens (`tiny_hf_dir`)."""
  from tests.engine_fixtures import tiny_hf_dir
  return tiny_hf_dir(str(tmp_path_factory.mktemp("tiny_llama")))


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer(smollm2_gguf):
  import transformers
  folder, name = os.path.split(smollm2_gguf)
  return transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)


@pytest.fixture(scope="session")
def hf_smollm2_model(smollm2_gguf):
  import torch
  import transformers
  folder, name = os.path.split(smollm2_gguf)
  model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                            dtype=torch.float32)
  return model.eval()
