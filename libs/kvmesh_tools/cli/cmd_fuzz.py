"""``kvmesh fuzz``: random and mutated messages to every gRPC method of running services.

Without ``--target`` it starts a small local stack (indexer, offload store, one decode and
one prefill sim worker, router) and fuzzes all of it. Prints (or writes) a JSON report:
status codes per method, UNKNOWN count and samples, hangs, and which services were
unhealthy afterwards. Exit status 1 if there was any UNKNOWN, hang or unhealthy service.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile

from kvmesh_tools.bench.common import write_json

log = logging.getLogger(__name__)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fuzz", help="fuzz every gRPC method of running (or freshly started) services")
    p.add_argument("--target", action="append", default=[],
                   help="host:port of a gRPC server (repeatable; none = start a local stack)")
    p.add_argument("--messages", type=int, default=10_000, help="messages to send in all")
    p.add_argument("--concurrency", type=int, default=8, help="calls in flight")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--call-timeout-s", type=float, default=10.0, help="a call silent this long is a hang")
    p.add_argument("--json", default=None, help="write the report here (default: print it)")
    p.add_argument("--tls-cert", default="", help="client certificate for --target servers with mTLS")
    p.add_argument("--tls-key", default="", help="its private key")
    p.add_argument("--tls-ca", default="", help="CA bundle of the servers")
    p.add_argument("--stack-tls", default="on", choices=["on", "off"],
                   help="the local stack's mTLS (on: fuzz as its admin identity; off: plaintext, so the "
                        "servicers behind the role checks are reached too)")
    p.set_defaults(func=_run)


def fuzz(addresses: list[str], args: argparse.Namespace, tls: object = None) -> dict[str, object]:
    from kvmesh_tools.fuzz.runner import Fuzzer

    with Fuzzer(addresses, seed=args.seed, call_timeout_s=args.call_timeout_s, tls=tls) as f:  # type: ignore[arg-type]
        report = f.run(args.messages, concurrency=args.concurrency)
    return {"targets": addresses, **report.to_json()}


def _run(args: argparse.Namespace) -> int:
    if args.target:
        from kvmesh.rpc.tls import TlsConfig

        tls = TlsConfig(tls="auto", tls_cert=args.tls_cert, tls_key=args.tls_key, tls_ca=args.tls_ca)
        out = fuzz(list(args.target), args, tls if tls.enabled() else None)
    else:
        from kvmesh_tools.stack.launcher import LocalStack, StackConfig

        with tempfile.TemporaryDirectory(prefix="kvmesh-fuzz-") as tmp:
            cfg = StackConfig(decode_workers=1, prefill_workers=1, redis="off", time_scale=50.0,
                              offload_ram_bytes=256 << 20, log_dir=tmp, tls=args.stack_tls)
            with LocalStack(cfg) as stack:
                addrs = [stack.router_address, stack.indexer_address, stack.offload_address,
                         *stack.decode_addresses.values(), *stack.prefill_addresses.values()]
                n_procs = len(stack.procs)
                out = fuzz(addrs, args, stack.client_tls())
                out["stack_tls"] = args.stack_tls
                out["dead_processes"] = n_procs - len(stack.alive())
    if args.json:
        write_json(args.json, out)
    else:
        print(json.dumps(out, indent=2))
    bad = out["unknown"] or out["hangs"] or out["unhealthy"] or out.get("dead_processes")
    return 1 if bad else 0
