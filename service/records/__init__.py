"""Handoff records on the decode: every accepted handoff and its outcome, kept across restarts
in `kvhandoff.service.storage`, and the handoff list merged from this life's handoffs and the
records."""
