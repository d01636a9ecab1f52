"""Engine backends behind one interface (``kvmesh.engine.base``): ``sim`` and ``vllm``."""
