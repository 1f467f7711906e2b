"""Running one model over several devices: the mesh, how params and the KV cache shard over it,
attention per shard (heads over `tensor`, pages over `context` with a query ring), data-parallel
engines, and multi-host setup."""
