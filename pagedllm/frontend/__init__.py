"""The front end of the engine: the sync and async engines, the client of the engine core (this
thread, another thread or another process), prompt normalisation and the output processor
(detokenisation, stop strings)."""
