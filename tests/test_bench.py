"""Smoke tests of the offline benchmark (`jinfer bench` on a tiny random model, JSON checked),
the benchmark modules of `jinfer.bench` run as scripts, and `jinfer generate`'s progress lines."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from jinfer.bench.offline import RandomWorkload
from jinfer.cli import main
from tests.engine_fixtures import TINY_DIR_VOCAB as VOCAB  # the `tiny_model_dir` fixture's


def test_random_workload_is_seeded_and_in_range():
  w = RandomWorkload(num_prompts=20, input_len_min=3, input_len_max=9, seed=5)
  a, b = w.prompts(VOCAB), w.prompts(VOCAB)
  assert a == b
  assert all(3 <= len(p) <= 9 and all(0 <= t < VOCAB for t in p) for p in a)
  assert a != RandomWorkload(num_prompts=20, input_len_min=3, input_len_max=9, seed=6).prompts(VOCAB)


@pytest.mark.slow
def test_bench_cli_reports_a_complete_run(tiny_model_dir, tmp_path, capsys):
  out = tmp_path / "bench.json"
  n, out_len = 6, 5
  # Few seqs and a small page budget: the run saturates, so the saturated-only fields are set.
  main(["bench", "--model", tiny_model_dir, "--num-prompts", str(n), "--input-len-min", "4",
        "--input-len-max", "24", "--output-len", str(out_len), "--max-num-seqs", "3",
        "--max-num-batched-tokens", "32", "--seed", "1", "--out", str(out)])
  r = json.loads(out.read_text())
  assert r == json.loads(capsys.readouterr().out)

  prompts = RandomWorkload(num_prompts=n, input_len_min=4, input_len_max=24, output_len=out_len,
                           seed=1).prompts(VOCAB)
  assert {"cpu_model", "cpu_count", "jax_version", "backend"} <= set(r["machine"])
  assert r["config"]["engine"]["max_num_seqs"] == 3
  assert r["config"]["engine"]["max_model_len"] == 24 + out_len
  assert r["num_requests"] == r["completed"] == n
  assert r["input_tokens"] == sum(map(len, prompts))
  assert r["output_tokens"] == n * out_len  # ignore_eos: every request runs to its length
  assert r["wall_s"] > 0 and r["warmup_s"] > 0
  assert np.isclose(r["output_tokens_per_s"], r["output_tokens"] / r["wall_s"])
  assert np.isclose(r["total_tokens_per_s"],
                    (r["input_tokens"] + r["output_tokens"]) / r["wall_s"])
  assert np.isclose(r["requests_per_s"], n / r["wall_s"])
  for key in ("ttft_s", "tpot_s"):
    assert 0 < r[key]["p50"] <= r[key]["p99"]
  assert r["saturated_steps"] > 0
  assert 0 < r["kv_utilization_mean"] <= 1 and 0 < r["kv_pages_used_mean"] <= 1
  assert 0 < r["peak_pages_used"] <= r["usable_pages"]
  assert r["num_preemptions"] >= 0 and 0 <= r["prefix_hit_rate"] <= 1
  assert r["num_steps"] >= out_len
  assert r["expert_load"] is None  # a dense model


def test_varied_output_lengths_keep_the_prompts():
  fixed = RandomWorkload(num_prompts=30, input_len_min=3, input_len_max=9, output_len=20, seed=5)
  varied = RandomWorkload(num_prompts=30, input_len_min=3, input_len_max=9, output_len=20,
                          output_len_min=4, seed=5)
  assert fixed.output_lens() == [20] * 30
  lens = varied.output_lens()
  assert lens == varied.output_lens() and all(4 <= n <= 20 for n in lens) and len(set(lens)) > 5
  assert varied.prompts(VOCAB) == fixed.prompts(VOCAB)
  assert [p.max_tokens for p in varied.sampling_params()] == lens
  with pytest.raises(ValueError, match="output_len_min"):
    RandomWorkload(output_len=8, output_len_min=9)


# Quick: test_varied_output_lengths_keep_the_prompts (the workload), test_generate_cli_* (the CLI).
@pytest.mark.slow
@pytest.mark.parametrize("continuous", [True, False])
def test_bench_cli_varied_output_lengths(tiny_model_dir, tmp_path, capsys, continuous):
  out = tmp_path / "bench.json"
  main(["bench", "--model", tiny_model_dir, "--num-prompts", "6", "--input-len-min", "4",
        "--input-len-max", "12", "--output-len", "9", "--output-len-min", "2",
        "--max-num-seqs", "3", "--max-num-batched-tokens", "32", "--out", str(out)]
       + ([] if continuous else ["--no-continuous-batching"]))
  r = json.loads(out.read_text())
  lens = RandomWorkload(num_prompts=6, input_len_min=4, input_len_max=12, output_len=9,
                        output_len_min=2).output_lens()
  assert r["completed"] == 6 and r["output_tokens"] == sum(lens)
  assert r["config"]["workload"]["output_len_min"] == 2
  assert r["config"]["engine"]["continuous_batching"] == continuous


def _run_module(module: str, argv: list[str], capsys) -> dict:
  """`python -m module argv...` in this process; its JSON from stdout."""
  import runpy
  old = sys.argv
  sys.argv = [module] + argv
  try:
    runpy.run_module(module, run_name="__main__", alter_sys=True)
  finally:
    sys.argv = old
  return json.loads(capsys.readouterr().out)


@pytest.mark.slow
def test_decode_profile_script_accounts_for_the_step(tiny_model_dir, capsys):
  """The profile's parts are measured, add up to about the device step, and name the stack
  each batch ran (a batch of 1 runs unrolled on the CPU, a batch past the threshold scanned)."""
  r = _run_module("jinfer.bench.profile_decode", ["--model", tiny_model_dir, "--batches", "1,16",
                                                  "--context", "20", "--steps", "3",
                                                  "--repeats", "2"], capsys)
  one, many = r["batches"]
  assert (one["batch"], many["batch"]) == (1, 16)
  assert (one["rows_per_step"]["T"], many["rows_per_step"]["T"]) == (1, 16)
  assert one["scan_layers"] is False and many["scan_layers"] is True
  for b in r["batches"]:
    for k in ("layers_matmul_ms", "attention_ms", "lm_head_ms", "sampling_ms", "device_step_ms"):
      assert b[k] > 0, k
    assert b["engine_step_ms"] >= b["device_step_ms"] and b["host_ms"] >= 0
    assert b["output_tokens_per_s"] == pytest.approx(b["batch"] * 1e3 / b["engine_step_ms"])


@pytest.mark.slow
def test_single_stream_script_reports_every_mode(tiny_model_dir, capsys):
  r = _run_module("jinfer.bench.single_stream",
                  ["--model", tiny_model_dir, "--modes", "f32,int8", "--repeats", "2",
                   "--prompt-len", "8", "--output-len", "6", "--batch", "3",
                   "--batch-input-len-min", "4", "--batch-input-len-max", "9",
                   "--batch-output-len", "5"], capsys)
  f32, int8 = r["modes"]["f32"], r["modes"]["int8"]
  assert int8["weight_bytes"] < f32["weight_bytes"]
  for m in (f32, int8):
    assert len(m["single_stream_tok_s"]) == len(m["batch_tok_s"]) == 2
    assert m["single_stream_median"] > 0 and m["batch_median"] > 0
  assert "llama_cpp" in r  # None unless llama-cpp-python is installed


def test_generate_cli_prints_each_progress_line_once(tiny_model_dir):
  """`jinfer generate` in a fresh process: its progress lines come once, in its own format
  (importing orbax configures the root logger, which printed each a second time), and on lines
  of their own before the answer (the one-token step compiled lazily printed its line right
  after the answer's first word). stdout and stderr share one pipe, as on a terminal."""
  env = dict(os.environ, HF_HUB_OFFLINE="1")
  proc = subprocess.run(
      [sys.executable, "-m", "jinfer.cli", "generate", "--model", tiny_model_dir, "--raw",
       "--max-model-len", "64", "--max-tokens", "4", "t3 t4 t5"],
      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-4000:]
  lines = [l for l in proc.stdout.splitlines() if "-token step" in l]  # compiled or loaded
  assert len(lines) >= 4 and all(l.startswith("jinfer: ") for l in lines), proc.stdout[-4000:]
  assert len(set(lines)) == len(lines), proc.stdout[-4000:]
  assert "1-token step" in "".join(lines), proc.stdout[-4000:]


@pytest.mark.slow
def test_on_device_script_puts_the_estimate_beside_the_measurement(tiny_model_dir, capsys):
  """The chip benchmark runs on the CPU too: measured decode steps, MBU and the plan's estimate
  for each quantization and batch."""
  r = _run_module("jinfer.bench.on_device",
                  ["--model", tiny_model_dir, "--quantization", "none,int8", "--batches", "1,2",
                   "--context-len", "8", "--output-len", "4", "--target", "h100",
                   "--max-num-batched-tokens", "4"], capsys)
  runs = {(x["quantization"], x["batch"]): x for x in r["runs"]}
  assert set(runs) == {(q, b) for q in (None, "int8") for b in (1, 2)}
  assert runs["int8", 1]["weight_bytes"] < runs[None, 1]["weight_bytes"]
  for x in runs.values():
    assert x["step_seconds"] > 0 and x["estimate_step_seconds"] > 0 and x["mbu"] > 0
    assert x["measured_over_estimate"] == pytest.approx(x["step_seconds"]
                                                        / x["estimate_step_seconds"])


@pytest.mark.slow  # a subprocess with its own compile (~15 s)
def test_generate_cli_answers_with_a_lora_adapter(tiny_model_dir, tmp_path):
  """`jinfer generate --lora DIR` sizes the slots to the adapter and answers with it: the text
  of an engine serving the same adapter, not the base model's."""
  import peft
  import torch
  import transformers
  from jinfer import LoRARequest, SamplingParams
  from jinfer.engine.engine import LLMEngine
  from jinfer.engine.engine_config import EngineConfig
  torch.manual_seed(0)
  hf = transformers.LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
  model = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                                  target_modules=["q_proj", "down_proj"]))
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "lora_B" in name:
        p.mul_(20.0)
  model.save_pretrained(str(tmp_path / "adapter"))
  args = ["--model", tiny_model_dir, "--raw", "--max-model-len", "64", "--max-tokens", "6",
          "t3 t4 t5"]
  def cli(*extra):
    proc = subprocess.run([sys.executable, "-m", "jinfer.cli", "generate", *extra, *args],
                          env=dict(os.environ, HF_HUB_OFFLINE="1"), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout.rstrip("\n")
  got = cli("--lora", str(tmp_path / "adapter"))
  engine = LLMEngine(tiny_model_dir, config=EngineConfig.of(max_model_len=64, enable_lora=True,
                                                            max_lora_rank=4), warmup="never")
  params = SamplingParams(max_tokens=6, temperature=0.0)
  rids = [engine.add_request(None, "t3 t4 t5", params, lora_request=lora)
          for lora in (LoRARequest("a", 1, str(tmp_path / "adapter")), None)]
  out = engine.run_to_completion()
  want, base = (out[r].outputs[0].text for r in rids)
  assert got == want != base
