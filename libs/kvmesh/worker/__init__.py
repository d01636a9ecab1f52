"""The worker library shared by the prefill and decode services.

``run_worker(role, argv)`` (``kvmesh.worker.run``) is the whole service;
``WorkerServicer`` implements the gRPC contract over any engine;
``WorkerMetrics`` exposes vLLM-named Prometheus metrics. Import submodules
directly; this package stays import-light (the HTTP API pulls in FastAPI).
"""
