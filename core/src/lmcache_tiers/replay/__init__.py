"""Trace replay and cache simulation: size tiers and choose policies from real traffic.

``trace`` reads Mooncake-format traces (one JSON object per line: ``timestamp`` in ms,
``input_length``, ``output_length`` and ``hash_ids``, the prompt's block ids in prefix
order), ``model``/``simulate`` replay them against a model of the server's L1 (and an
optional L2) for every eviction policy, ``belady`` gives the optimal and infinite-cache
hit rates, and ``server``/``inprocess`` replay them with real bytes through a running
server or a StorageManager of this process.
"""
