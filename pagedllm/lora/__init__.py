"""Multi-LoRA serving: PEFT adapters loaded and checked, their weights stacked in slots, and the batched
per-row deltas (each token gathers its own adapter's A and B) added to the model's fused projections."""
