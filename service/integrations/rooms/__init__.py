"""The engine-neutral half of an engine adapter: its rooms (one record per request and handoff),
their one transition table (`states`), a decode rank's handoff records and the release an
engine's "pages may be freed" signal reads (`decode`), a prefill rank's room records with chunk
-> page-range signalling and the fan-out replay (`prefill`), and the neutral outcome each
handoff event means for its room (`outcomes`), which an adapter maps to its engine's status
table. No engine is imported here: SGLang's backend (`kvhandoff.service.integrations.sglang`) uses
it, and so can a second adapter (a vLLM KV connector)."""
