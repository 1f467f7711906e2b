"""The training text of jinfer's self-distilled artifacts: chat prompts written for this project,
and the teacher's own greedy answers to them as token sequences on disk.

Each prompt is an instruction template filled with a subject. Training and evaluation use
disjoint subject lists, so an evaluation (and `jinfer.bench.speculative`'s chat workload) never
asks what a draft or the heads were trained on; the instruction styles are shared, as a real chat
workload repeats its styles. `generate_answers` turns prompts into the training sequences of both
`jinfer.training.distill` (the SeqKD draft) and `jinfer.training.medusa_train` (the heads).
"""
from __future__ import annotations

import logging
import os
import random
import time

import numpy as np

log = logging.getLogger("teacher_answers")

TEMPLATES = (
    "Explain {} in simple terms.",
    "Write a short paragraph about {}.",
    "What are three interesting facts about {}?",
    "How would you explain {} to a ten-year-old?",
    "What are the pros and cons of {}?",
    "Summarize the history of {} in a few sentences.",
    "Give me a step-by-step guide to getting started with {}.",
    "Write a short poem about {}.",
    "What are common misconceptions about {}?",
    "Write a short blog post introduction about {}.",
    "List five questions a student might ask about {}, with brief answers.",
    "Why does {} matter in everyday life?",
    "Compare {} with something similar and explain the differences.",
    "Write a friendly email inviting a colleague to a talk about {}.",
    "Describe {} in exactly three sentences.",
    "What should a beginner know before learning about {}?",
)

TRAIN_SUBJECTS = (
    "photosynthesis", "the water cycle", "black holes", "volcanoes", "the human heart",
    "climate change", "the Roman Empire", "the printing press", "electric cars",
    "machine learning", "the stock market", "vaccines", "plate tectonics", "honeybees",
    "the French Revolution", "renewable energy", "the immune system", "coffee", "chess",
    "the Moon landing", "recycling", "DNA", "the Internet", "gravity", "rainforests",
    "the Great Wall of China", "meditation", "inflation", "solar panels", "dinosaurs",
    "the Olympic Games", "sleep", "bread baking", "the periodic table", "earthquakes",
    "social media", "the Renaissance", "jazz music", "antibiotics", "cloud computing",
    "the ocean tides", "composting", "public libraries", "bicycles", "the speed of light",
    "supply and demand", "ancient Egypt", "the Python programming language", "gardening",
    "time zones", "the human brain", "bird migration", "democracy", "rainbows",
    "nuclear power", "the Silk Road", "healthy eating", "weather forecasting", "coral reefs",
    "password security", "the steam engine", "volunteering", "the solar system",
    "origami", "the theory of evolution", "electric circuits", "marathon running",
    "public speaking", "the Industrial Revolution", "sourdough starters", "glaciers",
    "budgeting", "3D printing", "the metric system", "wind turbines", "penguins",
)

EVAL_SUBJECTS = (
    "lightning", "the Amazon River", "quantum computing", "tea ceremonies", "the Eiffel Tower",
    "batteries", "octopuses", "the Cold War", "photography", "deserts", "blood types",
    "the Mars rovers", "board games", "tsunamis", "the violin", "compound interest",
    "the Byzantine Empire", "fermentation", "satellites", "recycling plastic", "owls",
    "magnetism", "the Panama Canal", "yoga", "the human skeleton", "jet engines",
    "the Aztecs", "spreadsheets", "hurricanes", "mushrooms", "the telescope", "elections",
)

CODING_TASKS = (
    "Write a Python function that checks whether a string is a palindrome.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Write a Python function that counts the words in a text.",
    "Write a Python function that reverses a linked list.",
    "Write a Python function that merges two sorted lists.",
    "Write a Python function that removes duplicates from a list while keeping order.",
    "Write a Python class for a simple bank account with deposit and withdraw methods.",
    "Write a Python function that converts Celsius to Fahrenheit.",
    "Write a Python function that finds the largest number in a list without max().",
    "Write a Python function that checks whether a number is prime.",
    "Write a Python function that flattens a nested list.",
    "Write a Python function that computes the factorial of a number recursively.",
    "Explain what a Python dictionary is and show an example.",
    "Explain the difference between a list and a tuple in Python.",
    "Write a SQL query that selects the ten most recent orders from an orders table.",
    "Write a Python function that sorts a list of dictionaries by a key.",
    "Explain what recursion is with a short code example.",
    "Write a Python function that reads a CSV file and prints each row.",
    "Write a JavaScript function that debounces another function.",
    "Explain what a hash table is and why lookups are fast.",
)

EVAL_CODING_TASKS = (
    "Write a Python function that checks whether two strings are anagrams.",
    "Write a Python function that computes the greatest common divisor of two numbers.",
    "Write a Python function that returns all even numbers from a list.",
    "Explain what a Python generator is with an example.",
    "Write a Python function that capitalizes the first letter of every word.",
    "Write a Python function that implements binary search.",
    "Explain the difference between a stack and a queue.",
    "Write a Python function that counts vowels in a string.",
)


def _prompts(subjects, tasks, seed: int) -> list[str]:
  out = [t.format(s) for s in subjects for t in TEMPLATES] + list(tasks)
  random.Random(seed).shuffle(out)
  return out


def train_prompts() -> list[str]:
  """1,236 prompts: every template with every training subject, plus coding tasks."""
  return _prompts(TRAIN_SUBJECTS, CODING_TASKS, seed=0)


def eval_prompts(n: int | None = None) -> list[str]:
  """Held-out prompts (subjects and coding tasks never seen in training), shuffled."""
  out = _prompts(EVAL_SUBJECTS, EVAL_CODING_TASKS, seed=1)
  return out if n is None else out[:n]


# -- the teacher's answers --------------------------------------------------------------------

def save_seqs(path: str, seqs: list[np.ndarray], starts: list[int]):
  offsets = np.cumsum([0] + [len(s) for s in seqs])
  np.savez(path, tokens=np.concatenate(seqs).astype(np.int32), offsets=offsets,
           prompt_lens=np.asarray(starts, np.int32))


def load_seqs(path: str) -> tuple[list[np.ndarray], list[int]]:
  """(token sequences, where each one's trained part starts)."""
  d = np.load(path)
  return np.split(d["tokens"], d["offsets"][1:-1]), d["prompt_lens"].tolist()


def generate_answers(model: str, prompts: list[str], path: str, max_tokens: int, chunk: int):
  """Greedy answers of `model` to `prompts` through its chat template, saved to `path` (prompt +
  answer per sequence) every `chunk` prompts, so an interrupted run resumes."""
  from jinfer import LLM, SamplingParams
  seqs, starts = load_seqs(path) if os.path.exists(path) else ([], [])
  llm = LLM(model, max_model_len=max_tokens + 128, max_num_seqs=64)
  params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
  t0 = time.monotonic()
  for start in range(len(seqs), len(prompts), chunk):
    ids = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                             add_generation_prompt=True, tokenize=True)
           for p in prompts[start:start + chunk]]
    outs = llm.generate(ids, params, use_tqdm=False)
    for p, o in zip(ids, outs):
      seqs.append(np.asarray(p + o.outputs[0].token_ids, np.int32))
      starts.append(len(p))
    save_seqs(path, seqs, starts)
    log.info("%d/%d prompts, %d answer tokens, %.0f s", len(seqs), len(prompts),
             sum(map(len, seqs)) - sum(starts), time.monotonic() - t0)
