"""``cloudckpt bench``: save, load and async throughput against the raw limit of the store.

Modules: :mod:`.workload` (a synthetic GPT-like sharded state), :mod:`.raw` (the limit:
the same bytes through the best raw client, no cloudckpt on top), :mod:`.runner` (the
rank processes and what each measures), :mod:`.report` (table, JSON, PNG) and
:mod:`.servers` (a SeaweedFS S3 server on a loopback port for ``--server seaweedfs``).
Nothing here is imported by the library itself.
"""
