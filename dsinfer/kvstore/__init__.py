"""The KV cache store: prefix KV beyond GPU memory, in tiers composed GPU -> host memory -> a directory.

- ``keys``: a grain's key (the prefix cache's block hash chain, cut every ``grain`` tokens, with the model's
  fingerprint) and the fingerprint itself;
- ``entry``: one grain's file (header: format version, fingerprint, layer layout, token count, TTL, checksum);
- ``host``: the host-memory tier (a byte budget, pinned on CUDA, LRU under high / low watermarks, TTL);
- ``directory``: the directory tier (local disk or a shared POSIX file system; several engines may share one);
- ``gc``: expiry and LRU sweeps of a directory (the background thread's and ``dsinfer kvstore gc DIR``'s);
- ``store``: the worker's ``KVStore`` (the tiers, the write-behind queue, the loader thread);
- ``index``: the engine's metadata view (how many tokens of a prefix are stored), read at admission.

It imports core, config and envs only: the engine (``index``) and the runner (``store``) both use it.
"""
