"""Generate the Python gRPC stubs from ``protos/`` into ``libs/``.

The stubs are committed so that a service image needs no protoc; the test
``tests/test_layout_rules.py`` regenerates them into a temporary folder and
fails when the committed copies are stale.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import grpc_tools
from grpc_tools import protoc

REPO = Path(__file__).resolve().parents[2]


def proto_files(proto_root: Path) -> list[Path]:
    return sorted(proto_root.rglob("*.proto"))


def generate(proto_root: Path, out: Path) -> list[Path]:
    """Run protoc for every proto under ``proto_root``; return the written files."""
    proto_root, out = proto_root.resolve(), out.resolve()
    files = proto_files(proto_root)
    include = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{proto_root}",
        f"-I{include}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *[str(f.relative_to(proto_root)) for f in files],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed")
    written: list[Path] = []
    for f in files:
        pkg_dir = out / f.relative_to(proto_root).parent
        # Regular packages (not namespace packages) so setuptools and mypy agree.
        for d in [pkg_dir, *pkg_dir.relative_to(out).parents]:
            init = out / d / "__init__.py" if d != Path(".") else None
            if init is not None and not init.exists():
                init.write_text("")
        stem = f.stem
        written += [pkg_dir / f"{stem}_pb2.py", pkg_dir / f"{stem}_pb2.pyi", pkg_dir / f"{stem}_pb2_grpc.py"]
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--protos", type=Path, default=REPO / "protos")
    ap.add_argument("--out", type=Path, default=REPO / "libs")
    ns = ap.parse_args(argv)
    for p in generate(ns.protos, ns.out):
        sys.stdout.write(f"{p}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
