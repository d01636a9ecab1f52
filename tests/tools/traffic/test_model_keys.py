"""Shared chained keys: the same values as computing each request's chain on its own."""

from __future__ import annotations

import random

from kvmesh_tools.traffic.generator import GeneratorConfig, generate
from kvmesh_tools.traffic.model import Request, chain_keys, common_len, share_chain_keys


def test_common_len_is_the_leading_run() -> None:
    rng = random.Random(3)
    for _ in range(500):
        a = [rng.randrange(4) for _ in range(rng.randrange(0, 12))]
        b = a[:rng.randrange(0, len(a) + 1)] + [rng.randrange(4) for _ in range(rng.randrange(0, 6))]
        want = 0
        while want < min(len(a), len(b)) and a[want] == b[want]:
            want += 1
        assert common_len(a, b) == want == common_len(b, a)


def test_shared_keys_equal_each_chain_alone() -> None:
    rng = random.Random(5)
    reqs = []
    for i in range(300):
        ns = f"ns{rng.randrange(3)}"
        prev = [r for r in reqs if r.namespace == ns]
        ids = (rng.choice(prev).hash_ids[:rng.randrange(0, 30)] if prev and rng.random() < 0.8 else [])
        ids = ids + [rng.randrange(50) for _ in range(rng.randrange(0, 10))]
        reqs.append(Request(uid=str(i), session="s", agent="main", t=0.0, input_tokens=len(ids) * 16 + 1,
                            output_tokens=1, hash_ids=ids, namespace=ns, block_size=16))
    share_chain_keys(reqs)
    for r in reqs:
        assert r.keys == chain_keys(r.namespace, r.hash_ids)


def test_a_sessions_turns_share_their_key_objects() -> None:
    trace = generate(GeneratorConfig(sessions=3, turns_median=6, seed=1))
    share_chain_keys(trace.requests())
    main = [r for r in trace.sessions[0].requests() if r.agent == "main"]
    assert len(main) >= 2
    for a, b in zip(main, main[1:], strict=False):
        n = common_len(a.hash_ids, b.hash_ids)
        assert n > 0 and all(x is y for x, y in zip(a.keys[:n], b.keys[:n], strict=True))
        assert b.keys == chain_keys(b.namespace, b.hash_ids)
