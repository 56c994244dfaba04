"""kvhandoff as an SGLang PD-disaggregation transfer backend (`--disaggregation-transfer-backend
kvhandoff`). SGLang loads `plugin.register` from the `sglang.srt.plugins` entry point in every
process; the backend's classes live in `backend.py` (manager, sender, receiver) and
`bootstrap.py` (the authenticated bootstrap server). Nothing here is imported by the service
itself: importing this package's modules needs SGLang installed.
"""
