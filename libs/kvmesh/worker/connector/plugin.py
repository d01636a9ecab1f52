"""vLLM general plugin (entry point ``vllm.general_plugins``) of the light ``kvmesh-connector`` wheel.

Why: with the plugin registered, ``--kv-transfer-config
'{"kv_connector": "KvmeshConnector", ...}'`` needs no ``kv_connector_module_path``,
also as a child of vLLM's ``MultiConnector``. vLLM runs general plugins in
every process, possibly more than once, so registering is idempotent. Nothing
here imports vLLM before vLLM calls it.
"""

from __future__ import annotations

from kvmesh.worker.connector import CONNECTOR_CLASS, CONNECTOR_MODULE


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector(CONNECTOR_CLASS, CONNECTOR_MODULE, CONNECTOR_CLASS)
    except ValueError:
        pass  # already registered in this process
