"""Speculative decoding: proposers of draft tokens (n-gram lookup, a draft model), their
configuration, counters, and the distillation of a draft. The verify step itself is the
engine's (`jinfer/engine/step_input.py`, `jinfer/accept.py`)."""
