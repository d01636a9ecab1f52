"""A generic gRPC fuzzer over every method of every kvmesh service (issue #20).

Random and damaged messages, built from the descriptors the servers reflect, go to
a real local stack (router, indexer, offload store, decode and prefill sim workers,
each its own process). Every answer must be a deliberate status: no ``UNKNOWN``,
no process exit, no call that hangs, every service healthy afterwards. The command
``kvmesh fuzz --messages 10000`` runs the same at scale.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmesh_tools.fuzz.runner import Fuzzer
from kvmesh_tools.stack.launcher import LocalStack, StackConfig

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    # Plaintext and no API keys, so every servicer behind the role and key checks is reached (with
    # mTLS on, most of a stranger's calls stop at PERMISSION_DENIED: tests/security/test_mtls_stack.py;
    # without a key, the router's at UNAUTHENTICATED: tests/security/test_front_auth.py).
    cfg = StackConfig(decode_workers=1, prefill_workers=1, redis="off", time_scale=50.0, tls="off", auth="off",
                      offload_ram_bytes=128 << 20, log_dir=str(tmp_path_factory.mktemp("fuzz-stack")))
    with LocalStack(cfg) as s:
        yield s


def test_fuzz_every_method_of_every_service(stack: LocalStack) -> None:
    addrs = [stack.router_address, stack.indexer_address, stack.offload_address,
             *stack.decode_addresses.values(), *stack.prefill_addresses.values()]
    n_procs = len(stack.alive())
    with Fuzzer(addrs, seed=7, call_timeout_s=10.0) as f:
        services = {m.service for m in f.methods}
        assert {"kvmesh.router.v1.Router", "kvmesh.indexer.v1.Indexer", "kvmesh.offload.v1.Offload",
                "kvmesh.worker.v1.Worker"} <= services
        report = f.run(400, concurrency=4)
    assert report.messages >= 400
    assert report.unknown == 0, report.unknown_samples
    assert report.hangs == 0
    assert report.unhealthy == []
    assert len(stack.alive()) == n_procs
    # Garbage was refused as such, and every method was reached.
    assert report.codes["INVALID_ARGUMENT"] > 0
    assert len(report.by_method) == len({m.path for m in f.methods})


def test_fuzz_command_reports_json(stack: LocalStack, tmp_path: Path) -> None:
    import json

    from kvmesh_tools.cli.main import main

    out = tmp_path / "fuzz.json"
    rc = main(["fuzz", "--target", stack.offload_address, "--messages", "100", "--json", str(out)])
    data = json.loads(out.read_text())
    assert rc == 0 and data["unknown"] == 0 and data["messages"] >= 100
    assert all(p.startswith("/kvmesh.offload.v1.Offload/") for p in data["by_method"])


def test_fuzz_the_ext_proc_picker(stack: LocalStack, tmp_path: Path) -> None:
    """Envoy's ext_proc service (bidirectional stream) on a router in front of the stack's workers."""
    from tests.fixtures.router import start_router

    router, _ = start_router(tmp_path, list(stack.decode_addresses.items()), port_flags=["--extproc-port"])
    xport = router.flag_port("--extproc-port")
    try:
        with Fuzzer([f"127.0.0.1:{xport}"], seed=3, call_timeout_s=10.0) as f:
            assert {m.service for m in f.methods} == {"envoy.service.ext_proc.v3.ExternalProcessor"}
            report = f.run(150, concurrency=4)
        assert report.unknown == 0, report.unknown_samples
        assert report.hangs == 0 and report.unhealthy == [] and router.alive()
        assert report.codes["INVALID_ARGUMENT"] > 0 and report.codes["OK"] > 0
    finally:
        router.stop(grace_s=2)
