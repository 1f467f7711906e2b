"""Speculative decoding, a wing of the engine: the proposers of draft tokens (n-gram lookup, a
draft model, Medusa heads) behind one interface (`proposer`), their configuration, checkpoints,
counters and pausing. The verify step itself is the engine's (`jinfer/engine/step_input.py`)
over the sampling floor's acceptance walk (`jinfer/sampling/accept.py`); training a draft or
heads is `jinfer/training`'s."""
