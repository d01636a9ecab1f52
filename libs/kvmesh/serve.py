"""``python -m kvmesh.serve SERVICE [FLAGS...]``: the container entrypoint.

``kvmesh serve`` goes through the full CLI, which imports every subcommand
(simulator, plotting, demo) and with them dependencies a slim service image
does not carry. This launcher looks up only the one service's entry point, so
an image needs nothing beyond the shared library core and its own requirements.
"""

from __future__ import annotations

import sys
from importlib.metadata import entry_points

from kvmesh.logs import setup_logging


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    services = {ep.name: ep for ep in entry_points(group="kvmesh.services")}
    if not argv or argv[0] not in services:
        names = ", ".join(sorted(services)) or "(none installed)"
        sys.stderr.write(f"usage: python -m kvmesh.serve SERVICE [flags]; services: {names}\n")
        return 64
    setup_logging()
    fn = services[argv[0]].load()
    return int(fn(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
