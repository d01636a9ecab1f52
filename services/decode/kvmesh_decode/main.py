"""The decode worker service: generates tokens, restoring a prefill worker's KV from
the offload store when the request carries a handle, else doing its own prefill.

Thin by design: all behaviour lives in ``kvmesh.worker`` (shared with prefill).
"""

from __future__ import annotations

import sys

from kvmesh.worker.run import run_worker


def main(argv: list[str] | None = None) -> int:
    return run_worker("decode", argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
