"""`shm:<name>` pools: every region inside one file under /dev/shm, shared with another process.

Regions sit at the offsets `pack_offsets(sizes, align_bytes)` gives (published as `offsets`), so
an engine or a test maps the same file (`numpy.memmap`, `mmap`, `multiprocessing.shared_memory`)
and reads or writes any region. The creator sizes the file and unlinks it on close; an attacher
only checks that the file is large enough and never unlinks.

Plain `mmap` on the file rather than `multiprocessing.shared_memory`: on Python 3.11 an attaching
`SharedMemory` registers the segment with the resource tracker, which unlinks it when the
attaching process exits — under the creator's feet.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Sequence

import numpy as np

from kvhandoff.transport.errors import PoolError
from kvhandoff.transport.pool_base import Bytes, Pool, pack_offsets
from kvhandoff.transport.regions import Region

SHM_DIR = "/dev/shm"


def shm_path(name: str) -> str:
    if not name or "/" in name or name.startswith("."):
        raise PoolError(f"invalid shm pool name {name!r}", field="pool")
    return os.path.join(SHM_DIR, name)


class ShmPool(Pool):
    """Regions packed in `/dev/shm/<name>`; `create=True` makes (and later unlinks) the file."""

    kind = "shm"

    def __init__(
        self, name: str, sizes: Sequence[int], *, align_bytes: int, create: bool = True
    ) -> None:
        self.name = name
        self.path = shm_path(name)
        self.owner = create
        self.offsets, total = pack_offsets(sizes, align_bytes)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        try:
            fd = os.open(self.path, flags, 0o600)
        except OSError as exc:
            raise PoolError(f"cannot open shm pool {self.path}: {exc}", field="pool") from exc
        try:
            if create:
                os.ftruncate(fd, total)
            elif os.fstat(fd).st_size < total:
                have = os.fstat(fd).st_size
                raise PoolError(
                    f"shm pool {self.path} holds {have} bytes, the layout needs {total}",
                    field="pool",
                )
            self._mmap: mmap.mmap | None = mmap.mmap(fd, total)
        except OSError as exc:
            if create:
                os.unlink(self.path)
            raise PoolError(f"cannot map shm pool {self.path}: {exc}", field="pool") from exc
        finally:
            os.close(fd)
        self._array = np.frombuffer(self._mmap, dtype=np.uint8)
        base = int(self._array.ctypes.data)
        regions = [Region(base + off, int(size)) for off, size in zip(self.offsets, sizes)]
        super().__init__(regions, [Region(base, total)])

    def view(self, index: int) -> Bytes:
        # A slice of the mapping (not a raw address view) so a live view keeps it mapped.
        self._check_open()
        start = self.offsets[index]
        return self._array[start : start + self.regions[index].length]

    def _release(self) -> None:
        del self._array
        mm, self._mmap = self._mmap, None
        try:
            if mm is not None:
                mm.close()
        except BufferError:
            # A caller still holds a view(): leave the mapping to the garbage collector rather
            # than pull memory from under it. The file is unlinked all the same.
            pass
        finally:
            if self.owner:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path)
