#!/usr/bin/env python
"""Capture block-hash vectors from a REAL vLLM engine's KV events.

Why: kvmesh's BlockHasher must produce the very hashes a vLLM 0.32 engine publishes.
Unit tests compare against these recorded vectors, so they need no vLLM at test time, and
re-running this script after a vLLM upgrade shows at once whether hashing changed.

Each case runs in its own child process (the NONE_HASH seed and the hash algo are fixed
per engine process): a tiny dummy-weight Llama (config.json only, ``load_format=dummy``)
on the CPU with prefix caching and ZMQ KV events on. Token-id prompts (some sharing
prefixes, some with a cache_salt) are generated one at a time; the BlockStored events
received after each are recorded with the request's tokens.

Usage: python scripts/capture_vllm_vectors.py [--out tests/data/vllm_hash_vectors.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BLOCK_SIZE = 32

# (name, algo, PYTHONHASHSEED or None, VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES, with a LoRA adapter)
CASES = [
    ("sha256_default", "sha256", None, True, False),
    ("sha256_cbor", "sha256_cbor", None, True, False),
    ("sha256_cbor_seeded_raw", "sha256_cbor", "4242", False, False),
    ("sha256_seeded_raw", "sha256", "7", False, False),
    ("xxhash_seeded", "xxhash", "12345", True, False),
    ("xxhash_cbor_seeded_raw", "xxhash_cbor", "12345", False, False),
    ("sha256_cbor_lora", "sha256_cbor", None, True, True),
]
LORA_NAME = "sql-adapter"
LORA_RANK = 8

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 32000,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def write_lora_adapter(path: Path, rank: int = LORA_RANK) -> None:
    """A PEFT-format LoRA (q_proj, v_proj) for the tiny Llama, with small random weights."""
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    cfg = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
        "target_modules": ["q_proj", "v_proj"], "bias": "none", "fan_in_fan_out": False,
        "modules_to_save": None, "base_model_name_or_path": None,
    }  # fmt: skip
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(0)
    hidden = TINY_LLAMA["hidden_size"]
    head_dim = hidden // TINY_LLAMA["num_attention_heads"]
    outs = {"q_proj": hidden, "v_proj": TINY_LLAMA["num_key_value_heads"] * head_dim}
    tensors = {}
    for layer in range(TINY_LLAMA["num_hidden_layers"]):
        for mod, out in outs.items():
            pre = f"base_model.model.model.layers.{layer}.self_attn.{mod}"
            tensors[f"{pre}.lora_A.weight"] = torch.randn(rank, hidden, generator=g) * 0.01
            tensors[f"{pre}.lora_B.weight"] = torch.randn(out, rank, generator=g) * 0.01
    save_file(tensors, str(path / "adapter_model.safetensors"))


def make_lora_requests(seed: int = 7) -> list[dict]:
    """Same tokens with and without the adapter, plus salt: LoRA keys go on every block."""
    rng = random.Random(seed)
    base = [rng.randrange(3, 32000) for _ in range(130)]
    return [
        {"prompt_token_ids": base, "cache_salt": None, "lora": False},
        {"prompt_token_ids": base, "cache_salt": None, "lora": True},
        {"prompt_token_ids": base + [5] * 40, "cache_salt": None, "lora": True},  # extends the LoRA chain
        {"prompt_token_ids": base, "cache_salt": "tenant-a", "lora": True},
    ]


def make_requests(seed: int = 20260530) -> list[dict]:
    """Prompts exercising: partial last block, shared prefixes, cache_salt, salt reuse."""
    rng = random.Random(seed)

    def toks(n: int) -> list[int]:
        return [rng.randrange(3, 32000) for _ in range(n)]

    base = toks(100)
    shared = base[:64] + toks(70)
    long_ = toks(300)
    return [
        {"prompt_token_ids": base, "cache_salt": None},
        {"prompt_token_ids": shared, "cache_salt": None},  # extends a cached 2-block prefix
        {"prompt_token_ids": base, "cache_salt": "tenant-a"},  # same tokens, salted
        {"prompt_token_ids": shared, "cache_salt": "tenant-a"},
        {"prompt_token_ids": long_, "cache_salt": "tenant-b"},
        {"prompt_token_ids": toks(31), "cache_salt": None},  # no full block
        {"prompt_token_ids": toks(64), "cache_salt": None},  # exactly 2 blocks
    ]


def _jsonable_hash(h):
    return h.hex() if isinstance(h, bytes) else h


def run_case(name: str, algo: str, with_lora: bool, out_path: Path) -> None:
    """Child process: start vLLM, send the requests, record events."""
    import msgspec
    import zmq
    from vllm import LLM, SamplingParams
    from vllm.distributed.kv_events import KVEventBatch

    with tempfile.TemporaryDirectory(prefix="kvmesh-tiny-llama-") as model_dir:
        Path(model_dir, "config.json").write_text(json.dumps(TINY_LLAMA))
        lora_path = str(Path(model_dir, "lora-sql"))
        lora_kwargs: dict = {}
        if with_lora:
            write_lora_adapter(Path(lora_path))
            lora_kwargs = {"enable_lora": True, "max_lora_rank": LORA_RANK, "max_loras": 1}
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        port = sub.bind_to_random_port("tcp://127.0.0.1")
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        topic = f"kv@capture@{name}"
        probe = ctx.socket(zmq.ROUTER)
        replay_port = probe.bind_to_random_port("tcp://127.0.0.1")
        probe.close(linger=0)  # free port for vLLM's ROUTER (tiny race, fine for a script)
        llm = LLM(
            model=model_dir,
            skip_tokenizer_init=True,
            load_format="dummy",
            enforce_eager=True,
            block_size=BLOCK_SIZE,
            max_model_len=1024,
            kv_cache_memory_bytes=64 * 1024 * 1024,
            enable_prefix_caching=True,
            prefix_caching_hash_algo=algo,
            seed=0,
            **lora_kwargs,
            # A connect endpoint: vLLM's PUB connects to our bound SUB, so nothing is lost
            # to the slow-joiner problem.
            kv_events_config={
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": f"tcp://127.0.0.1:{port}",
                "topic": topic,
                "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
            },
        )
        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        expect_seq = 0

        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{replay_port}")

        def replay_from(start: int) -> dict[int, bytes]:
            # vLLM's replay protocol: [b"", start_seq] -> [b"", topic, seq, payload]* + end marker.
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            got: dict[int, bytes] = {}
            while True:
                if not dealer.poll(10_000):
                    raise SystemExit("replay timed out")
                _, t, seq_b, payload = dealer.recv_multipart()
                if t == b"" and seq_b == b"\xff" * 8 and payload == b"":
                    return got
                got[int.from_bytes(seq_b, "big")] = payload

        def drain(wait_s: float) -> list[dict]:
            nonlocal expect_seq
            live: dict[int, bytes] = {}
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline:
                if not sub.poll(200):
                    if live:
                        break
                    continue
                t, seq_b, payload = sub.recv_multipart()
                if t.decode() != topic:
                    raise SystemExit(f"unexpected topic {t!r}")
                live[int.from_bytes(seq_b, "big")] = payload
            # PUB drops messages until our subscription reaches it, and a batch may still
            # be in flight: the replay buffer is authoritative, so always fill from it.
            live.update(replay_from(expect_seq))
            got: list[dict] = []
            for seq in sorted(live):
                if seq < expect_seq:
                    continue
                if seq != expect_seq:
                    raise SystemExit(f"sequence gap: got {seq}, want {expect_seq}")
                expect_seq += 1
                batch = decoder.decode(live[seq])
                for ev in batch.events:
                    if type(ev).__name__ != "BlockStored":
                        continue
                    got.append(
                        {
                            "block_hashes": [_jsonable_hash(h) for h in ev.block_hashes],
                            "parent_block_hash": _jsonable_hash(ev.parent_block_hash),
                            "token_ids": list(ev.token_ids),
                            "block_size": ev.block_size,
                            "extra_keys": ev.extra_keys,
                            "medium": ev.medium,
                            "lora_id": ev.lora_id,
                            "lora_name": ev.lora_name,
                        }
                    )
            return got

        from vllm.lora.request import LoRARequest

        records = []
        for req in make_lora_requests() if with_lora else make_requests():
            prompt = {"prompt_token_ids": req["prompt_token_ids"]}
            if req["cache_salt"]:
                prompt["cache_salt"] = req["cache_salt"]
            use_lora = req.pop("lora", False)
            lora_req = LoRARequest(LORA_NAME, 1, lora_path) if use_lora else None
            out = llm.generate([prompt], params, use_tqdm=False, lora_request=lora_req)[0]
            records.append(
                {
                    **req,
                    "lora_name": LORA_NAME if use_lora else None,
                    "lora_path": lora_path if use_lora else None,
                    "output_token_ids": list(out.outputs[0].token_ids),
                    "num_cached_tokens": out.num_cached_tokens,
                    "events": drain(2.0),
                }
            )
        out_path.write_text(json.dumps({"records": records}))
        sub.close(linger=0)
        dealer.close(linger=0)
        del llm
        ctx.term()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "tests/data/vllm_hash_vectors.json"))
    ap.add_argument("--case", help=argparse.SUPPRESS)
    ap.add_argument("--case-out", help=argparse.SUPPRESS)
    ap.add_argument("--only", nargs="*", help="case names to run (default all)")
    args = ap.parse_args(argv)

    if args.case:
        _, algo, _, _, with_lora = next(c for c in CASES if c[0] == args.case)
        run_case(args.case, algo, with_lora, Path(args.case_out))
        return 0

    import vllm

    cases_out = []
    for name, algo, hashseed, int_hashes, with_lora in CASES:
        if args.only and name not in args.only:
            continue
        env = dict(os.environ)
        env.pop("PYTHONHASHSEED", None)
        if hashseed is not None:
            env["PYTHONHASHSEED"] = hashseed
        env["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = "1" if int_hashes else "0"
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
            case_out = Path(tmp.name)
        print(f"[capture] case {name}: algo={algo} PYTHONHASHSEED={hashseed} int_hashes={int_hashes}", flush=True)
        t0 = time.monotonic()
        rc = subprocess.call(
            [sys.executable, __file__, "--case", name, "--case-out", str(case_out)], env=env, timeout=600
        )
        if rc != 0:
            print(f"[capture] case {name} FAILED rc={rc}", file=sys.stderr)
            return 1
        data = json.loads(case_out.read_text())
        case_out.unlink()
        n_ev = sum(len(r["events"]) for r in data["records"])
        print(f"[capture] case {name}: {n_ev} BlockStored events in {time.monotonic() - t0:.0f}s", flush=True)
        cases_out.append(
            {
                "name": name,
                "algo": algo,
                "pythonhashseed": hashseed,
                "int_block_hashes": int_hashes,
                "block_size": BLOCK_SIZE,
                "lora": with_lora,
                "records": data["records"],
            }
        )
    out_path = Path(args.out)
    if args.only and out_path.exists():
        # keep the other cases of an existing vectors file
        old = json.loads(out_path.read_text())
        mine = {c["name"] for c in cases_out}
        cases_out = [c for c in old["cases"] if c["name"] not in mine] + cases_out
        order = [c[0] for c in CASES]
        cases_out.sort(key=lambda c: order.index(c["name"]) if c["name"] in order else len(order))
    doc = {
        "vllm_version": vllm.__version__,
        "captured_by": "scripts/capture_vllm_vectors.py",
        "model": "tiny dummy LlamaForCausalLM (hidden 128, 4 heads, 2 layers, 2 kv heads, vocab 32000)",
        "note": "hashes are ints (64-bit event form) or hex strings (full digests, int_block_hashes=false)",
        "cases": cases_out,
    }
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"[capture] wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
