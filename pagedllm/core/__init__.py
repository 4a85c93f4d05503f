"""The engine core: the step loop, the scheduler, sequences, beam search and speculation. It talks to
the executor below and to the front end above only in ``pagedllm.protocol`` data."""
