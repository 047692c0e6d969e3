"""``cloudckpt bench``: save, load and async throughput against the raw limit of the store.

Modules: :mod:`.workload` (a synthetic GPT-like sharded state), :mod:`.options` (the run's
settings), :mod:`.raw` and :mod:`.raw_rounds` (the limit: the same bytes through the best
raw client, no cloudckpt on top), :mod:`.phases` (cloudckpt's phases), :mod:`.measure`
(timing a phase, memory, a rank's figures), :mod:`.runner` (the rank processes),
:mod:`.clock`, :mod:`.report` (table, JSON, PNG) and :mod:`.servers` (a SeaweedFS S3 server
on a loopback port for ``--server seaweedfs``). Nothing here is imported by the library.
"""
