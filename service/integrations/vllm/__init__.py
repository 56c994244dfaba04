"""kvhandoff as a vLLM KV connector (V1 connector API): `connector.KVHandoffConnector`, which
vLLM loads by `kv_connector_module_path` or by name through the `plugin.py` entry point. Its
halves: `scheduler.py` (vLLM's scheduler) and `worker.py` (each worker, one embedded service
over vLLM's KV caches, `layouts.py`); what they exchange: `metadata.py`; the settings:
`settings.py`; the start-up refusals: `support.py`. Importing this package needs no vLLM;
`connector.py` and `metadata.py` (vLLM's base classes) do.
"""
