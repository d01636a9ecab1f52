"""Turn an embedded index's ``LookupResult`` into the routing core's ``Matches``.

The live router gets matches over gRPC; the benchmark and the cluster
simulator query a :class:`kvmesh.index.base.BlockIndex` in-process. Offload
stores are endpoints too; their blocks are restorable by every decode
endpoint, so they go into ``Matches.store``.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvmesh.index.base import LookupResult, Tier
from kvmesh.routing.types import Matches, TierMatch


def matches_from_lookup(result: LookupResult, stores: Iterable[str] = ()) -> Matches:
    stores = set(stores)
    out = Matches()
    for eid, m in result.matches.items():
        tm = TierMatch(gpu=m.tiers.get(Tier.GPU, 0), cpu=m.tiers.get(Tier.CPU, 0), disk=m.tiers.get(Tier.DISK, 0),
                       speculative=m.speculative)
        if eid in stores:
            out.store = out.store.merged(TierMatch(cpu=max(tm.cpu, tm.gpu), disk=tm.disk))
        else:
            out.per_endpoint[eid] = tm
    return out
