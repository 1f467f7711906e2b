"""The sampling floor, below the engine and speculation: sampling parameters (`params`), the
jitted sampler (`sample`), the acceptance walk over draft tokens (`accept`) and speculation
trees (`tree`)."""
