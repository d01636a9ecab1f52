"""Per-endpoint index matches as arrays, for an index that can answer that way.

The simulator's index answers a lookup with one row per endpoint slot. At fleet scale
every endpoint holds the shared system prompt, so an answer as one ``TierMatch`` per
endpoint meant hundreds of objects built, and read back into arrays, on every decision.
``EndpointColumns`` carries the rows as they are; ``ColumnLayout`` says where each row
lands in the router's endpoint order, worked out once per order.
"""

from __future__ import annotations

import numpy as np

from kvmesh.routing.types import TierMatch


class ColumnLayout:
    """The endpoint ids of a set of per-endpoint arrays (their order)."""

    def __init__(self, ids: list[str]) -> None:
        self.ids = list(ids)
        self.pos = {e: i for i, e in enumerate(self.ids)}
        self._aligned: tuple[dict[str, int], np.ndarray, np.ndarray] | None = None

    def align(self, pos: dict[str, int]) -> tuple[np.ndarray, np.ndarray]:
        """(rows here, their positions in ``pos``) for the endpoints both have.

        Kept for the last ``pos`` object, which is held so its identity stays its own: the
        router passes the same one while its endpoint set is unchanged.
        """
        got = self._aligned
        if got is None or got[0] is not pos:
            src = [i for i, e in enumerate(self.ids) if e in pos]
            dst = [pos[self.ids[i]] for i in src]
            got = self._aligned = (pos, np.asarray(src, dtype=np.intp), np.asarray(dst, dtype=np.intp))
        return got[1], got[2]


class EndpointColumns:
    """Leading matched blocks per tier, one array element per endpoint of ``layout``."""

    def __init__(self, layout: ColumnLayout, gpu: np.ndarray, cpu: np.ndarray, disk: np.ndarray) -> None:
        self.layout, self.gpu, self.cpu, self.disk = layout, gpu, cpu, disk

    def align(self, pos: dict[str, int]) -> tuple[np.ndarray, np.ndarray]:
        return self.layout.align(pos)

    def get(self, endpoint_id: str) -> TierMatch:
        i = self.layout.pos.get(endpoint_id)
        if i is None:
            return TierMatch()
        return TierMatch(int(self.gpu[i]), int(self.cpu[i]), int(self.disk[i]))
