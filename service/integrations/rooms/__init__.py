"""The engine-neutral half of an engine adapter: its rooms (one record per request and handoff),
their one transition table, and the release tracking an engine's "pages may be freed" signal
reads. No engine is imported here: SGLang's backend (`service.integrations.sglang`) uses it, and
so can a second adapter (a vLLM KV connector)."""
