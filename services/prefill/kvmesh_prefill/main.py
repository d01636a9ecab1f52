"""The prefill worker service: computes a prompt's KV, samples at most one token,
and hands the KV to the offload store, returning a handle a decode worker restores.

Thin by design: all behaviour lives in ``kvmesh.worker`` (shared with decode).
"""

from __future__ import annotations

import sys

from kvmesh.worker.run import run_worker


def main(argv: list[str] | None = None) -> int:
    return run_worker("prefill", argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
