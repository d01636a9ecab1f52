"""The ``sim`` engine: a faithful, GPU-free stand-in for vLLM.

``block_manager``, ``scheduler`` and ``latency`` are synchronous and I/O-free
(the cluster simulator reuses them in virtual time); ``engine`` wraps them in
the async ``kvmesh.worker.engine.base.Engine`` interface with KV events over ZMQ.
"""
