"""A Mooncake client and nothing else: what any process that reaches a service's transfer port
can do, with no kvhandoff credential. Run as a script (`python mooncake_probe.py TARGETS`) by
`test_mooncake_reach.py`; it imports only `mooncake` and the standard library.

TARGETS is JSON: `[{"target": "host:port", "addrs": [[addr, length], ...]}, ...]`. For each
target it asks the handshake for the first registered buffer (as P2PHANDSHAKE hands it to any
client), then writes 255 bytes of 0xFF at that buffer and at every address given, and prints
one JSON line: `{"target": ..., "first": addr, "writes": [[addr, rc], ...]}`.
"""

from __future__ import annotations

import ctypes
import json
import sys

from mooncake.engine import TransferEngine

PROBE_BYTES = 255


def main() -> None:
    targets = json.loads(sys.argv[1])
    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise SystemExit("the probe's engine did not start")
    payload = ctypes.create_string_buffer(b"\xff" * PROBE_BYTES, PROBE_BYTES)
    src = ctypes.addressof(payload)
    if engine.register_memory(src, PROBE_BYTES) != 0:
        raise SystemExit("the probe could not register its own bytes")
    for entry in targets:
        target = entry["target"]
        first = int(engine.get_first_buffer_address(target))
        writes = []
        for addr in [first, *(int(a) for a, _ in entry["addrs"])]:
            writes.append([addr, int(engine.transfer_sync_write(target, src, addr, PROBE_BYTES))])
        print(json.dumps({"target": target, "first": first, "writes": writes}), flush=True)


if __name__ == "__main__":
    main()
