"""The vLLM plugin: makes `KVHandoffConnector` a connector name vLLM knows, so
`--kv-transfer-config '{"kv_connector": "KVHandoffConnector", "kv_role": ...}'` needs no
`kv_connector_module_path`.

Called by vLLM's `load_general_plugins()` (entry point group `vllm.general_plugins`) in every
vLLM process. The class is registered lazily (vLLM imports it at its first lookup), so loading
the plugin costs nothing in a process that never uses the connector; a second call in the same
process changes nothing.
"""

from __future__ import annotations

NAME = "KVHandoffConnector"
MODULE = "kvhandoff.service.integrations.vllm.connector"


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(NAME, MODULE, NAME)
