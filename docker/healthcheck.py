"""The image's HEALTHCHECK: exit 0 when this container's service answers `GET /readyz` with 200.

Run by the container runtime (`HEALTHCHECK` in docker/Dockerfile, `healthcheck` in
docker/compose.yaml) inside the container, as `kvhandoff-healthcheck [CONFIG]`. It reads the
configuration exactly as `kvhandoff serve` does (the file, then `KVHANDOFF_*` variables), so it
probes the port the service actually listens on, whichever way that was set.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request

from kvhandoff.service.config import ConfigError, load_config

DEFAULT_CONFIG = "/etc/kvhandoff/config.toml"
TIMEOUT_S = 2.0
#: Addresses that mean "every interface" when listened on; the probe uses loopback instead.
_ANY = {"", "0.0.0.0", "::", "[::]"}


def probe_url(config_path: str, env: dict[str, str]) -> str:
    server = load_config(config_path, env).server
    host = "127.0.0.1" if server.host in _ANY else server.host
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{server.port}/readyz"


def main(argv: list[str]) -> int:
    path = argv[1] if len(argv) > 1 else DEFAULT_CONFIG
    try:
        url = probe_url(path, dict(os.environ))
    except ConfigError as exc:
        print(f"kvhandoff-healthcheck: {exc}", file=sys.stderr)
        return 1
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as resp:
            return 0 if resp.status == 200 else 1
    except (urllib.error.URLError, OSError) as exc:  # refused, 503 (HTTPError), timeout
        print(f"kvhandoff-healthcheck: {url}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
