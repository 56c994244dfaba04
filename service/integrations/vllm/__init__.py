"""kvhandoff as a vLLM KV connector (V1 connector API): `connector.KVHandoffConnector`, which
vLLM loads by `kv_connector_module_path` or by name through the `plugin.py` entry point. Its
halves: `scheduler.py` (vLLM's scheduler) and `worker.py` (each worker, one embedded service
over vLLM's KV caches, `layouts.py`); what they exchange: `metadata.py`; the settings:
`settings.py`; the start-up refusals: `support.py`. The package, `layouts.py`, `settings.py`
and `support.py` import no vLLM; the others import its base classes (through `metadata.py`).
"""
