"""What the kernel knows of the TCP connections between two local service processes.

The landed-mode tests stop processes mid-transfer and need facts, not sleeps: how many bytes of
an engine call the receiver's kernel acknowledged, and how many still sit in socket queues.
`ss -tinea` (inet_diag, no privileges needed) gives per socket its queues, inode and byte
counters; `/proc/<pid>/fd` says which process owns which socket inode.

Mooncake TCP sends each block on a pooled connection to the receiver's data port as a header
(`MOONCAKE_HEADER_BYTES`) followed by the block's bytes, and its receiving side reads them
straight into the destination address: bytes acknowledged on such a connection and no longer in
the receiver's queue are in the receiver's memory.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass

#: The engine's per-block request header (`SessionHeader`: u64 size, u64 addr, u8 opcode,
#: padded to 24 bytes), sent before each block's bytes on the connection.
MOONCAKE_HEADER_BYTES = 24

_PORT = re.compile(r":(\d+)$")


@dataclass(frozen=True)
class Sock:
    state: str
    recv_q: int
    send_q: int
    lport: int
    rport: int
    inode: int
    bytes_acked: int


def _inodes(pid: int) -> set[int]:
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            out.add(int(target[8:-1]))
    return out


def sockets(pid: int) -> list[Sock]:
    """The TCP sockets process `pid` owns now."""
    owned = _inodes(pid)
    text = subprocess.run(["ss", "-tinHea"], capture_output=True, text=True, check=True).stdout
    found: list[Sock] = []
    head: list[str] | None = None
    for line in text.splitlines():
        if not line[:1].isspace():
            head = line.split()
            continue
        if head is None:
            continue
        ino = re.search(r"ino:(\d+)", " ".join(head))
        if ino is None or int(ino[1]) not in owned:
            continue
        acked = re.search(r"bytes_acked:(\d+)", line)
        lport, rport = (_PORT.search(a) for a in head[3:5])
        found.append(
            Sock(
                state=head[0],
                recv_q=int(head[1]),
                send_q=int(head[2]),
                lport=int(lport[1]) if lport else 0,
                rport=int(rport[1]) if rport else 0,
                inode=int(ino[1]),
                bytes_acked=int(acked[1]) if acked else 0,
            )
        )
        head = None
    return found


def listening_ports(pid: int) -> set[int]:
    return {s.lport for s in sockets(pid) if s.state == "LISTEN"}


@dataclass(frozen=True)
class Wire:
    """The connections from a writer process to a reader's ports, at one instant."""

    acked: dict[int, int]  # writer socket inode -> bytes the reader's kernel acknowledged
    send_q: int  # bytes in the writer's send queues
    recv_q: int  # bytes in the reader's receive queues, not read by its process yet

    def acked_since(self, before: Wire) -> int:
        """Bytes acknowledged since `before` on connections open at both instants or new."""
        return sum(n - before.acked.get(ino, 0) for ino, n in self.acked.items())


def wire(writer: int, reader: int, ports: set[int]) -> Wire:
    """The writer's connections to the reader's `ports` (e.g. its transport's data port)."""
    out = [s for s in sockets(writer) if s.state == "ESTAB" and s.rport in ports]
    into = [s for s in sockets(reader) if s.state == "ESTAB" and s.lport in ports]
    writer_ports = {s.lport for s in out}
    return Wire(
        acked={s.inode: s.bytes_acked for s in out},
        send_q=sum(s.send_q for s in out),
        recv_q=sum(s.recv_q for s in into if s.rport in writer_ports),
    )
