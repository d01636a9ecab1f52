"""The kvmesh vLLM KV connector: offload finished KV blocks to the shared store and restore them.

Importing this package does not import vLLM; vLLM loads the connector class by
module path (``kv_connector_module_path``) inside its own processes.
"""

CONNECTOR_CLASS = "KvmeshConnector"
CONNECTOR_MODULE = "kvmesh.worker.connector.vllm_connector"

__all__ = ["CONNECTOR_CLASS", "CONNECTOR_MODULE"]
