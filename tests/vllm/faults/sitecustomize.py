"""The vLLM engine tests' decode faults (`tests/commit_faults.py`), and the worker's service URL
in the server's log.

On the decode server's PYTHONPATH only (`tests/vllm/test_kvhandoff_pair.py`): Python imports
`sitecustomize` at start-up in every process of the server. A handoff whose id holds
`CORRUPT_MARK` (the proxy's request id names it) has the KV of every committed segment corrupted
after its commit verified it (the negative control); one whose id holds `SLOW_MARK` has every
landed segment held `SLOW_COMMIT_S` before its commit (the failure cases). Other handoffs are
untouched. The connector's INFO log (each worker's service URL) goes to the server's output,
where the tests read the decode's kvhandoff API address.
"""

from __future__ import annotations

import logging

from tests.commit_faults import install

CORRUPT_MARK = "corrupt-kv"
SLOW_MARK = "slow-kv"
#: Below the prefill's peer request timeout (`servers.PEER_SILENCE_S`), which the held segment
#: notice must not reach.
SLOW_COMMIT_S = 3.0

# The test engines' KV is bfloat16.
install(
    corrupt=lambda hid: CORRUPT_MARK in hid,
    slow=lambda hid: SLOW_MARK in hid,
    slow_s=SLOW_COMMIT_S,
    value_bytes=2,
)
_log = logging.getLogger("kvhandoff.vllm")
_log.setLevel(logging.INFO)
_log.addHandler(logging.StreamHandler())
