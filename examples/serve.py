"""Serve a model over the OpenAI API: `python examples/serve.py --model smollm2-135m-instruct`.

The same as `jinfer serve` (every option of it applies); needs `pip install jinfer[serve]`.
Then, e.g.:
  curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \
    -d '{"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "Hi"}]}'
"""
import sys

from jinfer.cli import main

if __name__ == "__main__":
  main(["serve", *sys.argv[1:]])
