"""The contracts every layer of dsinfer shares, as plain data: the request's scheduling state (``request``), the
step plan the engine sends a worker and the output it gets back (``plan``, ``outputs``), the forward batch a model
reads (``forward_batch``) and what a layer stores per KV block (``kv_cache_spec``).

``core`` imports nothing of dsinfer but ``config`` and ``envs``; every other package may import it.
"""
