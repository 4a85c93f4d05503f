"""The worker side of the engine: one device's model, KV tensors, persistent batch and sampler."""
