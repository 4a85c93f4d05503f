"""What users call: the ``pagedllm`` command line, the ``LLM`` class and the demo job."""
