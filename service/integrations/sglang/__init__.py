"""kvhandoff as an SGLang PD-disaggregation transfer backend (`--disaggregation-transfer-backend
kvhandoff`). SGLang loads `plugin.register` from the `sglang.srt.plugins` entry point in every
process; the backend's classes live in `manager.py` (one per scheduler rank, with
`prefill_rank.py`: a prefill rank's rooms), `sender.py`, `receiver.py` and `bootstrap.py` (the
authenticated bootstrap server); `ids.py` names the handoffs, `refusals.py` says what is
refused at start-up. The engine-neutral half of the room logic is
`kvhandoff.service.integrations.rooms`. Nothing here is imported by the service itself: importing
this package's modules needs SGLang installed.
"""
