"""Session fixtures: the real SmolLM2 GGUF, HF transformers' tokenizer and model built from it,
a tiny random model over its vocabulary, and a tinier model directory.

Built once per session: transformers' GGUF loading takes seconds to tens of seconds on 2 cores.
"""
from __future__ import annotations

import functools
import os
from unittest import mock

import pytest

# Nothing may reach a model hub; set before any test module imports transformers.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# jinfer's log lines reach the tests' log capture (caplog) instead of a stderr handler of its own.
os.environ["JINFER_CONFIGURE_LOGGING"] = "0"

# The tests run on the CPU; with the compile-only tier's TPU and GPU compilers in the same venv
# (the test extra brings them), jax would otherwise try (and warn about) each at start.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

# Eight CPU devices for the sharding tests (before anything initializes the backend); every
# other test runs on the first, as on one device.
jax.config.update("jax_num_cpu_devices", 8)

from jinfer.engine import compilation_cache  # noqa: E402

# JAX's persistent compilation cache, process-wide, from the start: the first engine built would
# turn it on anyway, and from then on only, so the tests before it (or a kernel test file run
# alone) compiled everything afresh on every run.
compilation_cache.enable()

import torch  # noqa: E402

# HF transformers is the reference here, on small models and short sequences. With one OpenMP
# thread per core, a core that something else holds stalls every op on a spinning barrier: on a
# busy 2-core box SmolLM2's forward ran 3-7x slower with 2 threads than with 1.
torch.set_num_threads(1)


def pytest_xdist_auto_num_workers(config) -> int:
  """`-n auto` (pyproject's addopts): one worker per core, at most four. Each worker holds its
  files' engines and up to a few GB of compiled steps; more than four paid little on a
  compile-bound suite and would crowd a small machine's memory."""
  cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
  return max(1, min(cores or 1, 4))


# The files whose tests take longest, per tier (measured cold on 2 cores), scheduled first: the
# workers take whole files in collection order (pyproject's addopts keep xdist from reordering
# them by test count), and a long file taken last kept one worker busy for a quarter of a
# minute after the other ran out of work.
LONGEST_FIRST = ("test_compile_engine.py", "test_spec_engine.py", "test_compile_sharded.py",
                 "test_quant_algorithms.py", "test_spec_smollm2.py",
                 "test_parallel.py", "test_disaggregated.py",
                 "test_quantized_engine.py", "test_ragged_paged_attention.py",
                 "test_spec_lossless.py", "test_engine.py", "test_model_layout.py",
                 "test_int8_matmul.py", "test_medusa.py", "test_startup.py",
                 # one or two long tests each: before the many short files, never last
                 "test_kv_cache_quantization.py", "test_gemma3_270m.py", "test_distill.py",
                 "test_bench.py", "test_kernels_in_engine.py", "test_moe_engine.py",
                 "test_long_context.py", "test_compile_kernels.py")
QUICK_LONGEST_FIRST = ("test_quant_algorithms.py", "test_ragged_paged_attention.py",
                       "test_parallel.py", "test_startup.py", "test_spec_engine.py",
                       "test_quantized_engine.py", "test_int8_matmul.py", "test_engine.py",
                       "test_structured_outputs.py", "test_kv_cache_quantization.py",
                       "test_model_layout.py", "test_server_tools.py", "test_model_parity.py",
                       "test_accept.py", "test_llm_prompts.py", "test_medusa.py")


def pytest_collection_modifyitems(config, items):
  quick = "not slow" in (config.option.markexpr or "")
  rank = {name: i for i, name in enumerate(QUICK_LONGEST_FIRST if quick else LONGEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest as before


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
  from jinfer.weights.builtin import builtin_gguf_path
  return builtin_gguf_path("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def _tiny(tmp_path_factory, smollm2_gguf):
  from tests.engine_fixtures import tiny_loaded
  path = str(tmp_path_factory.mktemp("tiny"))
  return path, tiny_loaded(path, smollm2_gguf)


@pytest.fixture(scope="session")
def tiny_model(_tiny):
  """(config, params, tokenizer) of a 2-layer random Llama with SmolLM2's tokenizer."""
  return _tiny[1]


@pytest.fixture(scope="session")
def tiny_model_path(_tiny) -> str:
  """The HF directory `tiny_model` was loaded from: config.json and weights, no tokenizer."""
  return _tiny[0]


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
  import gguf
  import transformers
  folder, name = os.path.split(smollm2_gguf)
  # transformers rebuilds gguf's tensor-name table for every submodule (~400 times, 5-13 s on 2
  # cores); it is a pure function of (architecture, layers), so build it once.
  with mock.patch.object(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map)):
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                              dtype=torch.float32)
  return model.eval()


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_steps():
  """After each test module, drop JAX's in-memory compiled executables: one process runs many
  files, and hundreds of engines' executables (and their memory maps) accumulated to a native
  crash late in a one-process run. Later modules reload what they need from the persistent
  cache."""
  yield
  jax.clear_caches()
