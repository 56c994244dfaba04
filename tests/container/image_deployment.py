"""A `LocalDeployment` whose services run from the container image, for `make image-test`.

Each service gets its own working container (`buildah from IMAGE`) and is started in it with
`buildah run --isolation chroot` — the image's filesystem, user and entry point, on the host's
network (nothing here can run `podman run`: the runtime's setrlimit is refused). The harness
stays the engines' side as in `LocalDeployment`: it creates the shm pools under /dev/shm and
mounts /dev/shm and its work directory (configs, logs, state dirs) into every container at the
same paths, owned by the image's user so the non-root service can attach them.

`buildah run` does not pass SIGTERM on (it kills its child), so `stop()` signals the service
process itself — it runs in the host's pid namespace under chroot isolation — and reads its exit
status from `buildah run`, which exits with its command's status.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvhandoff.service.testing.deployment import LocalDeployment, ServiceProcess
from kvhandoff.transport.pool_shm import SHM_DIR

_PR_SET_PDEATHSIG = 1


def image_config(image: str) -> dict[str, Any]:
    """The image's config (User, Entrypoint, Cmd, ExposedPorts, Volumes, ...) and its
    Healthcheck (which podman reports beside the OCI config, not in it)."""
    out = subprocess.run(
        ["podman", "image", "inspect", image], check=True, capture_output=True, text=True
    ).stdout
    (inspected,) = json.loads(out)
    config: dict[str, Any] = {**inspected["Config"], "Healthcheck": inspected.get("Healthcheck")}
    return config


def _uid_gid(user: str) -> tuple[int, int]:
    """`USER 10001:10001` (the Dockerfile uses numbers, so no passwd lookup is needed here)."""
    uid, _, gid = user.partition(":")
    return int(uid), int(gid or uid)


def _die_with_parent() -> None:
    # Runs in the child before exec: if the test process dies, `buildah run` gets SIGTERM and
    # takes the service down with it, instead of leaving it bound to its ports.
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class ImageDeployment(LocalDeployment):
    """`LocalDeployment(**kwargs)` with every service started from `image`."""

    def __init__(self, image: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.image = image
        self.image_config = image_config(image)
        self.uid, self.gid = _uid_gid(self.image_config["User"])
        self.containers: dict[str, str] = {}  # process name -> working container id

    def _plan_processes(self) -> None:
        super()._plan_processes()
        assert self.work_dir is not None
        # The services run as the image's user: they write their state dirs under the work dir
        # and map the pool files the harness created.
        os.chown(self.work_dir, self.uid, self.gid)
        for path in self.work_dir.iterdir():
            os.chown(path, self.uid, self.gid)
        pools = [self.stage_pool(r) for r in self.stage_layouts]
        for pool in [*pools, self.decode_pool]:
            os.chown(Path(SHM_DIR) / pool.name, self.uid, self.gid)

    def _launch(self, proc: ServiceProcess) -> None:
        work = str(self.work_dir)
        container = subprocess.run(
            ["buildah", "from", "--quiet", "--pull-never", self.image],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        self.containers[proc.name] = container
        # ENTRYPOINT + the arguments a deployment gives in place of CMD: the image's own entry.
        command = [*self.image_config["Entrypoint"], "serve", "--config", str(proc.config_path)]
        cmd = [
            "buildah", "run", "--isolation", "chroot", "--network", "host",
            "--volume", f"{work}:{work}", "--volume", f"{SHM_DIR}:{SHM_DIR}",
            container, "--", *command,
        ]  # fmt: skip
        with proc.log_path.open("wb") as log:
            proc.popen = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self._env,
                preexec_fn=_die_with_parent,
            )

    def run_in(self, name: str, command: Sequence[str]) -> subprocess.CompletedProcess[str]:
        """Run `command` in the working container of process `name` (its files, its user)."""
        work = str(self.work_dir)
        return subprocess.run(
            ["buildah", "run", "--isolation", "chroot", "--network", "host",
             "--volume", f"{work}:{work}", self.containers[name], "--", *command],
            capture_output=True,
            text=True,
            check=False,
        )  # fmt: skip

    def service_pid(self, name: str) -> int:
        """The pid of the `kvhandoff serve` process inside `buildah run` for process `name`."""
        popen = self.process(name).popen
        assert popen is not None
        children: dict[int, list[int]] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                with contextlib.suppress(OSError):
                    stat = Path(f"/proc/{entry}/stat").read_text()
                    ppid = int(stat.rsplit(")", 1)[1].split()[1])
                    children.setdefault(ppid, []).append(int(entry))
        # buildah run -> its chroot helper (argv: the command) -> the service: take the deepest.
        todo, found = [(popen.pid, 0)], []
        while todo:
            pid, depth = todo.pop()
            with contextlib.suppress(OSError):
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                if b"serve" in argv and pid != popen.pid:
                    found.append((depth, pid))
            todo += [(child, depth + 1) for child in children.get(pid, [])]
        if not found:
            raise LookupError(f"no kvhandoff serve process under buildah run {popen.pid}")
        return max(found)[1]

    def stop(self, names: Sequence[str], timeout_s: float) -> dict[str, int | None]:
        """SIGTERM the service processes `names` at once; their exit statuses (None: still
        running after `timeout_s`, then killed)."""
        for name in names:
            os.kill(self.service_pid(name), signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        codes: dict[str, int | None] = {}
        for name in names:
            popen = self.process(name).popen
            assert popen is not None
            try:
                codes[name] = popen.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                codes[name] = None
        return codes

    def close(self, grace_s: float = 5.0) -> None:
        try:
            super().close(grace_s)
        finally:
            for container in self.containers.values():
                subprocess.run(["buildah", "rm", container], capture_output=True, check=False)
            self.containers.clear()
