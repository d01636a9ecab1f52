"""``kvmesh hash``: print the block hashes a vLLM engine would publish for some token ids.

Users debug "why don't my hashes match the engine's" with it: feed the prompt's token ids
and the engine's settings (algo, block size, cache_salt, LoRA, PYTHONHASHSEED) and compare
with the ``block_hashes`` in the engine's ``BlockStored`` events.
"""

from __future__ import annotations

import argparse
import json
import sys

from kvmesh.hashing import BlockHasher, ExtraKeys, HashAlgo, event_key

EXIT_BAD_INPUT = 2


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "hash",
        help="vLLM block hashes of token ids read as a JSON list on stdin",
        description="Reads a JSON list of token ids (or {\"prompt_token_ids\": [...]}) on stdin; prints the "
        "JSON list of the 64-bit event-form block hashes (what vLLM puts in BlockStored.block_hashes). "
        "Only full blocks are hashed; include generated tokens if the engine's blocks contain them.",
    )
    p.add_argument("--algo", default="sha256", choices=[a.value for a in HashAlgo], help="--prefix-caching-hash-algo")
    p.add_argument("--block-size", type=int, required=True, help="engine block size (tokens)")
    p.add_argument("--cache-salt", default=None)
    p.add_argument("--lora-name", default=None)
    p.add_argument("--lora-path", default=None, help="LoRA adapter path, as the engine was given it")
    p.add_argument(
        "--seed",
        default=None,
        help="NONE_HASH seed; default: $PYTHONHASHSEED if set, else 'vllm-none-hash' (random for xxhash, like vLLM)",
    )
    p.add_argument("--digest", action="store_true", help="print full hex digests instead of 64-bit ints")
    p.add_argument("--verbose", "-v", action="store_true", help="print one JSON object per block with details")
    p.set_defaults(func=run)


def _fail(msg: str) -> int:
    sys.stderr.write(f"kvmesh hash: error: {msg}\n")
    return EXIT_BAD_INPUT


def _read_tokens(text: str) -> list[int]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"stdin is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    if isinstance(data, dict) and "prompt_token_ids" in data:
        data = data["prompt_token_ids"]
    if not isinstance(data, list):
        raise ValueError(f"expected a JSON list of token ids, got {type(data).__name__}")
    for i, t in enumerate(data):
        if isinstance(t, bool) or not isinstance(t, int):
            raise ValueError(f"token at index {i} is {json.dumps(t)}, not an integer")
        if t < 0:
            raise ValueError(f"token at index {i} is negative ({t})")
    return data


def run(args: argparse.Namespace) -> int:
    if args.block_size <= 0:
        return _fail(f"--block-size must be positive, got {args.block_size}")
    if args.lora_path and not args.lora_name:
        return _fail("--lora-path needs --lora-name")
    try:
        tokens = _read_tokens(sys.stdin.read())
    except ValueError as e:
        return _fail(str(e))
    hasher = BlockHasher(args.algo, args.block_size, seed=args.seed)
    if hasher.seed_is_random:
        sys.stderr.write(
            f"kvmesh hash: warning: {args.algo} without --seed or PYTHONHASHSEED uses a random seed "
            "(as vLLM does); these hashes match no engine\n"
        )
    extra = ExtraKeys(cache_salt=args.cache_salt, lora_name=args.lora_name, lora_path=args.lora_path)
    digests = hasher.block_digests(tokens, extra)
    if args.verbose:
        bs = args.block_size
        for i, d in enumerate(digests):
            row = {
                "block": i,
                "tokens": [i * bs, (i + 1) * bs],
                "key": event_key(d),
                "digest": d.hex(),
                "parent": (digests[i - 1] if i else hasher.none_hash).hex(),
            }
            sys.stdout.write(json.dumps(row) + "\n")
        return 0
    out = [d.hex() for d in digests] if args.digest else [event_key(d) for d in digests]
    sys.stdout.write(json.dumps(out) + "\n")
    return 0
