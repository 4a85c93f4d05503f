"""Benchmarks: ``pagedllm bench <name>`` (see ``pagedllm.bench.cli``)."""
