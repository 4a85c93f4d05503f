"""Tensor parallelism over torch.distributed: the process group (parallel_state), how weights split (sharding), and a local launcher."""
