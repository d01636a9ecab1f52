"""``kvmesh bench events``: KV-event codec throughput vs vLLM's msgspec structs.

The indexer decodes every engine's event stream; its ingest rate is bounded by this
codec. The baseline is vLLM's own typed msgspec decoder/encoder (if importable), which
is what a consumer written against vLLM's classes would use.
"""

from __future__ import annotations

import argparse
import gc
import random
import time
from collections.abc import Callable

from kvmesh.events import BlockRemoved, BlockStored, KVEventBatch, decode_batch, encode_batch
from kvmesh_tools.bench.common import median, write_json


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("events", help="KV-event codec encode/decode speed vs vLLM's msgspec structs")
    p.add_argument("--json", default=None)
    p.add_argument("--events", type=int, default=200, help="BlockStored events per batch")
    p.add_argument("--blocks-per-event", type=int, default=4)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--repeats", type=int, default=31)
    p.add_argument("--no-vllm", action="store_true", help="skip the vLLM baseline")
    p.set_defaults(func=run)


def _batch(args: argparse.Namespace) -> KVEventBatch:
    rng = random.Random(0)
    evs: list = []
    for _ in range(args.events):
        n = args.blocks_per_event
        evs.append(
            BlockStored(
                [rng.randrange(2**64) for _ in range(n)], rng.randrange(2**64),
                [rng.randrange(150_000) for _ in range(n * args.block_size)], args.block_size,
                None, "GPU", None, group_idx=0,
            )
        )  # fmt: skip
        evs.append(BlockRemoved([rng.randrange(2**64)], "GPU", group_idx=0))
    return KVEventBatch(time.time(), evs, 0)


def _interleaved(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median ms per contender, run in rotation so load changes hit all alike."""
    for fn in fns.values():
        fn()
    ts: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            ts[k].append((time.perf_counter() - t0) * 1000.0)
    return {k: round(median(v), 3) for k, v in ts.items()}


def run(args: argparse.Namespace) -> int:
    batch = _batch(args)
    payload = encode_batch(batch)
    n_tokens = sum(len(e.token_ids) for e in batch.events if isinstance(e, BlockStored))
    fns: dict[str, Callable[[], object]] = {
        "decode": lambda: decode_batch(payload),
        "encode": lambda: encode_batch(batch),
    }
    try:
        if args.no_vllm:
            raise ImportError("baseline disabled")
        import msgspec
        from vllm.distributed import kv_events as V

        dec = msgspec.msgpack.Decoder(type=V.KVEventBatch)
        enc = msgspec.msgpack.Encoder()
        vb = dec.decode(payload)
        assert enc.encode(vb) == payload, "codec output differs from vLLM's"
        fns["vllm_decode"] = lambda: dec.decode(payload)
        fns["vllm_encode"] = lambda: enc.encode(vb)
    except ImportError:
        pass
    # Importing vLLM leaves millions of live objects; freezing them keeps full GC passes
    # (triggered by whichever contender allocates GC-tracked objects) from timing that
    # heap instead of the codec. A service process (no vLLM import) has no such heap.
    gc.collect()
    gc.freeze()
    try:
        ms = _interleaved(fns, args.repeats)
    finally:
        gc.unfreeze()
    res: dict = {
        "bench": "events",
        "events_per_batch": len(batch.events),
        "tokens_per_batch": n_tokens,
        "payload_bytes": len(payload),
        **{f"{k}_ms_median": v for k, v in ms.items()},
    }
    res["decode_events_per_s"] = round(len(batch.events) / (res["decode_ms_median"] / 1000))
    if "vllm_decode" in ms:
        res["decode_ratio_vs_vllm"] = round(ms["decode"] / ms["vllm_decode"], 2)
        res["encode_ratio_vs_vllm"] = round(ms["encode"] / ms["vllm_encode"], 2)
    print(
        f"decode {res['decode_ms_median']:.2f} ms / batch of {len(batch.events)} events ({n_tokens} tokens)"
        + (f", vLLM msgspec {res['vllm_decode_ms_median']:.2f} ms" if "vllm_decode_ms_median" in res else "")
    )
    write_json(args.json, res)
    return 0
