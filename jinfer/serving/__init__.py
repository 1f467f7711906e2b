"""The OpenAI-compatible HTTP server (needs the `serve` extra) and a load generator for it."""
