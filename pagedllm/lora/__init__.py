"""Multi-LoRA serving: PEFT adapters loaded and checked, stored in KV blocks of the pool (unified paging), a
step's adapters stacked in compute slots, and the batched per-row deltas (each token its own adapter's A and B)
added to the model's fused projections."""
