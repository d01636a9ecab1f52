"""What a split request reused: the prompt tokens no worker computed for it.

The hit rate counts, per request, the prompt tokens no engine computed for it. A split
request runs on two engines. Its prefill endpoint reports what it found cached (its GPU and the
store) and computes the rest; its decode endpoint then restores that KV through the offload
store and reports all of it as cached. The restored part is a transfer, not reuse: the prefill
endpoint computed it for this request. And the store is an LRU: where it evicts part of the
prefill's KV before the decode endpoint restores it (a small store, a long decode queue), the
decode endpoint computes that part again, including any the prefill endpoint had found cached.

So a split reused the shorter of the two leading runs (both counts are prefixes of the prompt):
what the prefill endpoint found cached, cut to what the decode endpoint did not compute. Counting
the prefill's figure alone credited reuse that the decode endpoint recomputed; on the shared
traces with a 4M-token store that made `round_robin`, whose turns mostly split onto long decode
queues, look 0.09 of all prompt tokens better than it was (docs/bench-history.md, session 65).
The live router (`RouterService.count_reuse`) and the simulator both count a split here.
"""

from __future__ import annotations

from typing import NamedTuple


class SplitReuse(NamedTuple):
    gpu: int            # reused from the prefill endpoint's GPU
    offload: int        # reused from the store by the prefill endpoint
    transferred: int    # the decode endpoint's cached tokens that the prefill computed for the request
    lost: int           # the prefill endpoint's cached tokens the decode endpoint computed again


def split_reuse(prefill_gpu: int, prefill_offload: int, decode_cached: int) -> SplitReuse:
    """A split's reuse from its prefill endpoint's cached tokens per tier and its decode
    endpoint's cached count. The prompt's leading tokens are the GPU hit's, so a cut takes the
    store's part first."""
    found = max(0, prefill_gpu) + max(0, prefill_offload)
    decode_cached = max(0, decode_cached)
    reused = min(found, decode_cached)
    gpu = min(max(0, prefill_gpu), reused)
    return SplitReuse(gpu=gpu, offload=reused - gpu, transferred=decode_cached - reused, lost=found - reused)
