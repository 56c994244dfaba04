"""The ids of the handoffs SGLang's requests become: one per request (`bootstrap_room`) and
sending prefill attention-TP rank, `sglang-<room>-tp<rank>`, and for an MLA decode of k times
the prefill's attention TP one copy per decode rank of that prefill rank (`-r<i>` after the
first). Visible in each rank's API, events, webhooks and metrics.

Called by the manager (a prefill rank's own handoff and its copies) and the receiver (the
handoff a decode rank takes).
"""

from __future__ import annotations

import re


def handoff_id(room: int, tp_rank: int, copy: int = 0) -> str:
    """The id of the handoff prefill TP rank `tp_rank` sends for `room`; `copy` > 0: to the
    decode rank of that index among the ones it fans out to (an MLA decode of larger TP)."""
    base = f"sglang-{int(room)}-tp{int(tp_rank)}"
    return f"{base}-r{int(copy)}" if copy else base


_COPY = re.compile(r"^(.*)-r([1-9][0-9]*)$")


def own_of(hid: str) -> str:
    """The id a fanned-out copy's id is a copy of (the id itself when it is none)."""
    m = _COPY.match(hid)
    return m.group(1) if m else hid
