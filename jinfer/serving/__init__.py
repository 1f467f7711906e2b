"""The OpenAI-compatible HTTP server (needs the `serve` extra). Its load generator, behind
`jinfer bench-serve`, is a benchmark: `jinfer/bench/load_generator.py`."""
