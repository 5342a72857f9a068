"""Executors: run the engine's step plans on the model, in this process (``uni``) or in worker processes (``mp``),
chosen by vLLM's ``distributed_executor_backend``. The engine sees one interface (``base.Executor``)."""
