"""The kvhandoff KV connector for vLLM (V1 connector API): layouts from the worker's KV caches
(`layouts.py`) and the start-up refusals (`support.py`). Importing this package needs no vLLM."""
