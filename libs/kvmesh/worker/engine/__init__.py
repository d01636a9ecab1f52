"""Engine backends behind one interface (``kvmesh.worker.engine.base``): ``sim`` and ``vllm``."""
