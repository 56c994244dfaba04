"""docker/: the images' Dockerfiles, the compose deployment and the files they use, checked
without a container runtime.

- `docker/compose.yaml` is valid (`podman-compose --dry-run config` normalises it), every file it
  mounts exists, every kvhandoff service's command parses with the CLI, and its config agrees with
  the service around it: role, port, public URL, Mooncake hostname, peers, PP stages.
- Prometheus scrapes every kvhandoff service at its configured port; Grafana's provisioning
  points at that Prometheus and at the mounted dashboards folder.
- Both Dockerfiles parse, copy only files that exist and that `.dockerignore` lets into the
  context, and start `kvhandoff serve` with a config that is in the image.
- The image's health check probes the port the config names and answers by `/readyz`.
"""

from __future__ import annotations

import contextlib
import http.server
import importlib.util
import json
import re
import shlex
import subprocess
import sys
import threading
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from kvhandoff.service.cli import build_parser
from kvhandoff.service.config import Config, ConfigError, load_config
from kvhandoff.service.serve import SHUTDOWN_TIMEOUT_S

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
#: What docker/build-image.sh writes into the build context before `podman build`.
WHEELHOUSE = "build/wheelhouse"
IMAGE_CONFIG = "/etc/kvhandoff/config.toml"
COMPOSE = "docker/compose.yaml"


# -- Dockerfile parsing ------------------------------------------------------------------------


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case: FROM, RUN, COPY, ...
    args: str  # the rest, continuation lines joined

    def exec_form(self) -> list[str]:
        """The JSON (exec) form's argument list; fails the test on the shell form."""
        value = json.loads(self.args)
        assert isinstance(value, list), f"{self.keyword} {self.args}: not the exec form"
        return [str(v) for v in value]


def parse_dockerfile(path: Path) -> list[Instruction]:
    """Instructions in order: comments and blank lines dropped, `\\` continuations joined."""
    instructions, pending = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, args = (pending + line).partition(" ")
        pending = ""
        assert re.fullmatch(r"[A-Za-z]+", keyword), f"{path.name}: not an instruction: {line}"
        instructions.append(Instruction(keyword.upper(), args.strip()))
    assert not pending, f"{path.name} ends inside a continuation"
    return instructions


KNOWN = {
    "FROM", "ARG", "RUN", "COPY", "ADD", "ENV", "USER", "WORKDIR", "VOLUME", "EXPOSE",
    "HEALTHCHECK", "STOPSIGNAL", "ENTRYPOINT", "CMD", "LABEL", "SHELL",
}  # fmt: skip


def copies(instructions: list[Instruction]) -> list[tuple[list[str], str]]:
    """(sources, destination) of every COPY/ADD from the build context (not `--from=`)."""
    out = []
    for ins in instructions:
        if ins.keyword not in ("COPY", "ADD"):
            continue
        words = shlex.split(ins.args)
        if any(w.startswith("--from") for w in words):
            continue
        paths = [w for w in words if not w.startswith("--")]
        out.append((paths[:-1], paths[-1]))
    return out


def one(instructions: list[Instruction], keyword: str) -> Instruction:
    found = [i for i in instructions if i.keyword == keyword]
    assert found, f"no {keyword}"
    return found[-1]  # the last one counts, as in a build


def dockerignore_includes(path: str) -> bool:
    """Whether `.dockerignore` lets `path` (relative, `/`-separated) into the build context:
    the last pattern matching the path or one of its parent folders wins; `!` re-includes."""
    included = True
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        pattern = line.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negate = pattern.startswith("!")
        regex = _ignore_regex(pattern.lstrip("!").strip("/"))
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        if any(regex.fullmatch(p) for p in prefixes):
            included = negate
    return included


def _ignore_regex(pattern: str) -> re.Pattern[str]:
    out = ""
    for token in re.split(r"(\*\*/|\*\*|\*|\?)", pattern):
        out += {"**/": "(.*/)?", "**": ".*", "*": "[^/]*", "?": "[^/]"}.get(token, re.escape(token))
    return re.compile(out)


def context_files(source: str) -> list[str]:
    """The repository files a COPY source names (a folder: every file in it, caches aside)."""
    path = ROOT / source
    if path.is_dir():
        return [
            str(p.relative_to(ROOT))
            for p in sorted(path.rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts
        ]
    return [source] if path.is_file() else []


def serve_args(argv: list[str]) -> Any:
    """`kvhandoff ARGV` parsed by the real CLI; it must be `serve` (SystemExit on bad flags)."""
    args = build_parser(argv).parse_args(argv)
    assert args.command == "serve", argv
    return args


# -- the Dockerfiles ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cpu() -> list[Instruction]:
    return parse_dockerfile(DOCKER / "Dockerfile")


@pytest.fixture(scope="module")
def ascend() -> list[Instruction]:
    return parse_dockerfile(DOCKER / "Dockerfile.ascend")


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.ascend"])
def test_dockerfiles_use_only_known_instructions(name: str) -> None:
    instructions = parse_dockerfile(DOCKER / name)
    assert instructions[0].keyword in ("ARG", "FROM")
    assert {i.keyword for i in instructions} <= KNOWN


def test_cpu_image_is_multi_stage_on_a_base_given_as_build_argument(cpu: list[Instruction]) -> None:
    before_from = cpu[: next(i for i, ins in enumerate(cpu) if ins.keyword == "FROM")]
    assert Instruction("ARG", "BASE=python:3.11-slim-bookworm") in before_from
    froms = [i.args.split()[0] for i in cpu if i.keyword == "FROM"]
    assert froms == ["${BASE}", "${BASE}"]
    assert any("--from=builder" in i.args for i in cpu if i.keyword == "COPY")


def test_cpu_image_copies_only_the_wheelhouse_and_files_that_exist(cpu: list[Instruction]) -> None:
    for sources, _ in copies(cpu):
        for source in sources:
            if source.startswith(WHEELHOUSE):
                # Written by docker/build-image.sh before the build; wheels only.
                assert source.rstrip("/") in (f"{WHEELHOUSE}/deps", f"{WHEELHOUSE}/project")
                assert dockerignore_includes(f"{source.rstrip('/')}/x-1.0-py3-none-any.whl")
                continue
            files = context_files(source)
            assert files, f"COPY {source}: no such file"
            assert all(dockerignore_includes(f) for f in files), f"{source}: .dockerignore"
    assert f"WHEELHOUSE={WHEELHOUSE}\n" in (DOCKER / "build-image.sh").read_text()


def test_dockerignore_keeps_the_venv_and_tests_out() -> None:
    for path in (".venv/bin/python", "tests/fakes.py", ".git/HEAD", "service/__pycache__/x.pyc"):
        assert not dockerignore_includes(path), path
    assert dockerignore_includes("service/serve.py")


def test_cpu_image_runs_serve_as_a_non_root_user_on_its_config(cpu: list[Instruction]) -> None:
    uid, _, gid = one(cpu, "USER").args.partition(":")
    assert int(uid) > 0 and int(gid or uid) > 0
    assert one(cpu, "ENTRYPOINT").exec_form() == ["kvhandoff"]
    args = serve_args(one(cpu, "CMD").exec_form())
    assert args.config == IMAGE_CONFIG
    assert (["docker/image.toml"], IMAGE_CONFIG) in copies(cpu)
    assert one(cpu, "STOPSIGNAL").args == "SIGTERM"


def test_cpu_image_exposes_and_keeps_what_its_config_names(cpu: list[Instruction]) -> None:
    server = tomllib.loads((DOCKER / "image.toml").read_text())["server"]
    assert json.loads(one(cpu, "VOLUME").args) == [server["state_dir"]]
    exposed = one(cpu, "EXPOSE").args.split()
    assert f"{server['port']}/tcp" in exposed
    assert "15000-17000/tcp" in exposed  # Mooncake's handshake and data ports


def test_image_healthcheck_runs_the_copied_script(cpu: list[Instruction]) -> None:
    check = one(cpu, "HEALTHCHECK").args
    command = json.loads(check[check.index("CMD") + 3 :])
    assert command[-1] == "/opt/kvhandoff/bin/kvhandoff-healthcheck"
    assert (["docker/healthcheck.py"], command[-1]) in copies(cpu)


def test_ascend_image_copies_only_files_that_exist(ascend: list[Instruction]) -> None:
    sources = [s for srcs, _ in copies(ascend) for s in srcs]
    assert sources
    for source in sources:
        files = context_files(source)
        assert files, f"COPY {source}: no such file"
        assert all(dockerignore_includes(f) for f in files), f"{source}: .dockerignore"


def test_ascend_image_installs_the_npu_builds_and_serves(ascend: list[Instruction]) -> None:
    assert any(i.args.startswith("CANN_BASE=") for i in ascend if i.keyword == "ARG")
    assert one(ascend, "FROM").args == "${CANN_BASE}"
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert any(d.startswith("mooncake-transfer-engine-npu") for d in extras["ascend"])
    assert any(d.startswith("torch-npu") for d in extras["ascend"])
    install = " ".join(i.args for i in ascend if i.keyword == "RUN")
    assert '"/src[ascend]"' in install and "torch-npu==" in install
    entry = one(ascend, "ENTRYPOINT").exec_form()
    assert entry[-1] == "kvhandoff" and 'exec kvhandoff "$@"' in entry[2]
    assert serve_args(one(ascend, "CMD").exec_form()).config == IMAGE_CONFIG
    text = (DOCKER / "Dockerfile.ascend").read_text()
    for documented in ('protocol = "ascend"', "/etc/hccn.conf", "--device /dev/davinci0"):
        assert documented in text, documented


def test_image_config_with_environment_is_a_whole_config() -> None:
    env = {
        "KVHANDOFF_ROLE": "prefill",
        "KVHANDOFF_MODEL__PRESET": "dense-mha",
        "KVHANDOFF_SERVER__PUBLIC_URL": "http://prefill:8100",
        "KVHANDOFF_STAGES": '[{"pp_rank": 0, "pp_size": 1, "num_pages": 16}]',
    }
    config = load_config(DOCKER / "image.toml", env)
    assert (config.server.host, config.server.port) == ("0.0.0.0", 8100)
    assert config.server.state_dir == "/var/lib/kvhandoff"
    with pytest.raises(ConfigError) as info:
        load_config(DOCKER / "image.toml", {})
    assert str(info.value).startswith("role:")


# -- the compose deployment ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    """docker/compose.yaml as podman-compose normalises it (it rejects an invalid file)."""
    done = subprocess.run(
        [sys.executable, "-m", "podman_compose", "--dry-run", "-f", COMPOSE, "config"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    normalised: dict[str, Any] = yaml.safe_load(done.stdout)
    return normalised


def kvhandoff_services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        name: svc
        for name, svc in compose["services"].items()
        if svc.get("build", {}).get("dockerfile") == "docker/Dockerfile"
    }


def bind_mounts(svc: dict[str, Any]) -> dict[str, Path]:
    """Container path -> host path of every bind mount (named volumes left out)."""
    out = {}
    for volume in svc.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith((".", "/")):
            out[target] = (DOCKER / source).resolve()
    return out


def service_config(svc: dict[str, Any]) -> Config:
    args = serve_args(svc["command"])
    return load_config(bind_mounts(svc)[args.config], {})


def test_compose_runs_decode_and_one_container_per_prefill_stage(compose: dict[str, Any]) -> None:
    services = kvhandoff_services(compose)
    assert sorted(services) == ["decode", "prefill-0", "prefill-1"]
    configs = {name: service_config(svc) for name, svc in services.items()}
    assert configs["decode"].role == "decode"
    ranks = []
    for name in ("prefill-0", "prefill-1"):
        config = configs[name]
        assert config.role == "prefill" and config.pp_size == 2
        assert len(config.stages) == 1, f"{name}: one stage per container"
        ranks.append(config.stages[0].pp_rank)
        # Both sides describe the same model, or pairing refuses every handoff.
        assert config.model_spec() == configs["decode"].model_spec()
    assert sorted(ranks) == [0, 1]
    prefill_urls = sorted(configs[n].server.public_url for n in ("prefill-0", "prefill-1"))
    assert sorted(configs["decode"].peers.prefill) == prefill_urls


def test_compose_services_are_reachable_as_their_configs_say(compose: dict[str, Any]) -> None:
    for name, svc in kvhandoff_services(compose).items():
        server = service_config(svc).server
        assert server.public_url == f"http://{name}:{server.port}", name
        assert service_config(svc).transport.hostname == name
        assert svc["hostname"] == name
        published = [str(p).split(":")[-1] for p in svc["ports"]]
        assert published == [str(server.port)], name
        assert svc["healthcheck"]["test"][-1] == "/opt/kvhandoff/bin/kvhandoff-healthcheck"
        assert serve_args(svc["command"]).config == IMAGE_CONFIG
        assert any(v.endswith(f":{server.state_dir}") for v in svc["volumes"]), name


def test_compose_gives_each_service_twice_its_shutdown_bounds(compose: dict[str, Any]) -> None:
    # A SIGTERMed service waits for in-flight requests, then for the releases of what it aborted;
    # a stop period shorter than that (on a busy host, twice it) turns a clean exit into SIGKILL.
    for name, svc in kvhandoff_services(compose).items():
        bound_s = SHUTDOWN_TIMEOUT_S + service_config(svc).handoff.shutdown_grace_s
        period = re.fullmatch(r"(\d+)s", str(svc["stop_grace_period"]))
        assert period is not None, (name, svc["stop_grace_period"])
        assert int(period[1]) >= 2 * bound_s, (name, int(period[1]), bound_s)


def test_compose_mounts_only_files_that_exist(compose: dict[str, Any]) -> None:
    for name, svc in compose["services"].items():
        for target, source in bind_mounts(svc).items():
            assert source.exists(), f"{name}: {source} (mounted at {target}) does not exist"


def test_compose_waits_for_healthy_services_on_one_network(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert services["decode"]["depends_on"] == {
        "prefill-0": {"condition": "service_healthy"},
        "prefill-1": {"condition": "service_healthy"},
    }
    for name, svc in services.items():
        assert svc["networks"] == ["kvhandoff"], name
        assert "healthcheck" in svc, name
        for dep, condition in svc.get("depends_on", {}).items():
            assert condition == {"condition": "service_healthy"}, (name, dep)
            assert "healthcheck" in services[dep], dep


def test_prometheus_scrapes_every_kvhandoff_service(compose: dict[str, Any]) -> None:
    prom = compose["services"]["prometheus"]
    config_path = next(a.split("=", 1)[1] for a in prom["command"] if a.startswith("--config"))
    scrape = yaml.safe_load(bind_mounts(prom)[config_path].read_text())
    targets = {
        target
        for job in scrape["scrape_configs"]
        if job.get("metrics_path", "/metrics") == "/metrics"
        for static in job["static_configs"]
        for target in static["targets"]
    }
    for name, svc in kvhandoff_services(compose).items():
        assert f"{name}:{service_config(svc).server.port}" in targets, name


def test_grafana_provisions_the_prometheus_and_the_dashboards(compose: dict[str, Any]) -> None:
    grafana = compose["services"]["grafana"]
    mounts = bind_mounts(grafana)
    provisioning = grafana["environment"]["GF_PATHS_PROVISIONING"]

    def host_path(container_path: str) -> Path:
        for target, source in mounts.items():
            if container_path == target or container_path.startswith(target + "/"):
                return source / container_path[len(target) :].lstrip("/")
        raise AssertionError(f"{container_path} is not inside a mount of {sorted(mounts)}")

    sources = yaml.safe_load(
        (host_path(provisioning) / "datasources" / "prometheus.yaml").read_text()
    )["datasources"]
    prom_port = compose["services"]["prometheus"]["ports"][0].split(":")[-1]
    assert [s["url"] for s in sources] == [f"http://prometheus:{prom_port}"]
    providers = yaml.safe_load(
        (host_path(provisioning) / "dashboards" / "kvhandoff.yaml").read_text()
    )["providers"]
    dashboards = host_path(providers[0]["options"]["path"])
    assert dashboards == DOCKER / "grafana" / "dashboards"
    for board in dashboards.glob("*.json"):  # the metrics work adds kvhandoff.json here
        assert isinstance(json.loads(board.read_text()), dict), board


# -- the health check --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def healthcheck() -> ModuleType:
    path = DOCKER / "healthcheck.py"
    spec = importlib.util.spec_from_file_location("kvhandoff_healthcheck", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_healthcheck_probes_the_configured_port(healthcheck: ModuleType) -> None:
    decode = str(DOCKER / "decode.toml")
    assert healthcheck.probe_url(decode, {}) == "http://127.0.0.1:8200/readyz"
    env = {"KVHANDOFF_SERVER__PORT": "9001", "KVHANDOFF_SERVER__HOST": "10.0.0.7"}
    assert healthcheck.probe_url(decode, env) == "http://10.0.0.7:9001/readyz"


@contextlib.contextmanager
def readyz_server(status: int) -> Iterator[int]:
    """A loopback HTTP server answering `GET /readyz` with `status`; yields its port."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(status if self.path == "/readyz" else 404)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        thread.join()
        server.server_close()


@pytest.mark.parametrize(("status", "code"), [(200, 0), (503, 1)])
def test_healthcheck_exit_status_follows_readyz(
    healthcheck: ModuleType, tmp_path: Path, status: int, code: int
) -> None:
    with readyz_server(status) as port:
        config = tmp_path / "config.toml"
        text = (DOCKER / "prefill-0.toml").read_text()
        config.write_text(text.replace("port = 8100", f"port = {port}", 1))
        assert healthcheck.main(["kvhandoff-healthcheck", str(config)]) == code


def test_healthcheck_fails_on_a_bad_config(healthcheck: ModuleType, tmp_path: Path) -> None:
    assert healthcheck.main(["kvhandoff-healthcheck", str(tmp_path / "missing.toml")]) == 1


# -- docker/build-image.sh ---------------------------------------------------------------------


def debian_mirror(apt_etc: Path) -> subprocess.CompletedProcess[str]:
    """build-image.sh's `debian_mirror` run against the apt configuration under `apt_etc`."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(apt_etc), "APT_ETC": str(apt_etc)}
    return subprocess.run(
        ["bash", "-c", 'source "$1" && debian_mirror', "bash", str(DOCKER / "build-image.sh")],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )


DEB822 = """\
Types: deb
URIs: http://mirror.example/debian-security
Suites: bookworm-security
Components: main

Types: deb-src
URIs: http://src.example/debian
Suites: bookworm
Components: main

Types: deb
# a comment inside the stanza
URIs: http://mirror.example/debian http://second.example/debian
Suites: bookworm bookworm-updates
Components: main
"""


@pytest.mark.parametrize(
    ("files", "mirror"),
    [
        ({"sources.list.d/debian.sources": DEB822}, "http://mirror.example/debian"),
        (
            {
                "sources.list": "# deb http://old.example/debian bookworm main\n"
                "deb http://up.example/debian bookworm-updates main\n"
                "deb [arch=amd64 signed-by=/k.gpg] http://list.example/debian bookworm main\n"
            },
            "http://list.example/debian",
        ),
        ({"sources.list.d/other.list": "deb http://x.example/ubuntu jammy main\n"}, None),
    ],
)
def test_base_mirror_comes_from_the_apt_sources(
    tmp_path: Path, files: dict[str, str], mirror: str | None
) -> None:
    (tmp_path / "sources.list.d").mkdir()
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    done = debian_mirror(tmp_path)
    if mirror is None:
        assert done.returncode != 0 and "set DEBIAN_MIRROR" in done.stderr
    else:
        assert (done.returncode, done.stdout.strip()) == (0, mirror), done.stderr
