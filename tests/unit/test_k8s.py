"""docker/k8s/: the Kustomize base and overlays, rendered and checked without a cluster.

- Every kustomization renders with `kubectl kustomize` and every object it renders validates,
  strictly (unknown fields refused), against the Kubernetes schemas of the oldest and newest
  versions we name (`kubernetes-validate`, offline: the schemas ship inside the package).
- The rendered objects keep the promises the README makes, read against the configs in their
  own ConfigMaps: probes on /healthz and /readyz at the configured port, Services and the
  Prometheus annotations at that port, the Mooncake port range pinned, declared and admitted,
  public URL and transport hostname from the pod IP, credentials only by Secret reference (one
  per role), a grace period of twice the shutdown bounds, NetworkPolicies that admit Mooncake
  ports from kvhandoff pods only and namespaces only to HTTP, non-root and read-only roots
  where the overlay does not say why not, and the state volume at `server.state_dir`.
- Each ConfigMap config, with the environment its pod gives it, passes `kvhandoff serve
  --check`.
- `test_a_planted_*` break one rendered object at a time and expect the check to fail.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvhandoff.service.cli import main as kvhandoff
from kvhandoff.service.config import Config, load_config
from kvhandoff.service.embedded import embedded_layout
from kvhandoff.service.serve import SHUTDOWN_TIMEOUT_S
from kvhandoff.transport.pool_base import pack_offsets

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "docker" / "k8s"
KUSTOMIZATIONS = {
    "base": K8S / "base",
    "rdma": K8S / "overlays" / "rdma",
    "ascend": K8S / "overlays" / "ascend",
    "sidecar": K8S / "overlays" / "sidecar",
}
#: Schemas validated against: the oldest Kubernetes these manifests claim (NetworkPolicy
#: endPort is GA since 1.25) and the newest the package knows.
K8S_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())
DASHBOARD = ROOT / "docker" / "grafana" / "dashboards" / "kvhandoff.json"

#: What a test pod's downward API and Secrets would give it.
POD_IP = "10.244.3.17"
NPU_ID = "5"
#: Roles whose routes each service has, so each must have its secret (a role without one is
#: open): engine routes (stage ready) are the prefill's only.
ROLE_SECRETS = {"decode": {"router", "peer"}, "prefill": {"router", "engine", "peer"}}
#: Overlays that document why their pods run as root or write their root filesystem.
ROOT_USER = {"rdma", "ascend"}  # IPC_LOCK takes effect for root only; the Ascend image is root
WRITABLE_ROOT = {"ascend"}  # CANN's logs and caches under $HOME
KVHANDOFF_PODS = {"app.kubernetes.io/name": "kvhandoff"}
ROUTER_NAMESPACE = "kvhandoff-router"

Obj = dict[str, Any]


# -- rendering ---------------------------------------------------------------------------------


def kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        # CI machines ship kubectl: a missing one is a broken machine, not a reason to skip.
        pytest.fail("kubectl is not installed: `kubectl kustomize` renders docker/k8s")
    return path


@functools.cache
def _render(name: str) -> tuple[Obj, ...]:
    done = subprocess.run(
        [kubectl(), "kustomize", str(KUSTOMIZATIONS[name])],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return tuple(o for o in yaml.safe_load_all(done.stdout) if o)


def render(name: str) -> list[Obj]:
    """The rendered objects of one kustomization (a fresh copy: tests may break them)."""
    return copy.deepcopy(list(_render(name)))


def of_kind(objs: list[Obj], kind: str) -> list[Obj]:
    return [o for o in objs if o["kind"] == kind]


def named(objs: list[Obj], kind: str, name: str) -> Obj:
    found = [o for o in of_kind(objs, kind) if o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def workloads(objs: list[Obj]) -> list[Obj]:
    found = [
        o
        for o in objs
        if o["kind"] in ("StatefulSet", "Deployment")
        and selects(KVHANDOFF_PODS, o["spec"]["template"]["metadata"]["labels"])
    ]
    assert found, "no kvhandoff workloads"
    return found


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def container(workload: Obj, name: str = "kvhandoff") -> Obj:
    found = [c for c in workload["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    assert len(found) == 1, f"{workload['metadata']['name']}: no container {name}"
    return found[0]


# -- a pod's view: environment and config ------------------------------------------------------

_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def expand(value: str, defined: dict[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion: only variables defined earlier in the list; `$$` is `$`;
    a reference to anything else stays as written (so a misordered variable shows)."""

    def sub(m: re.Match[str]) -> str:
        if m[0] == "$$":
            return "$"
        return defined.get(m[1], m[0])

    return _REF.sub(sub, value)


def secret_value(name: str, key: str) -> str:
    return f"test-{name}-{key}"  # distinct per Secret, as the config requires per role


def pod_env(objs: list[Obj], workload: Obj, ctr: Obj) -> dict[str, str]:
    """The container's environment as the kubelet would set it (the test pod's IP, a made-up
    value per Secret key, ConfigMap keys from the rendered ConfigMaps)."""
    env: dict[str, str] = {}
    for var in ctr.get("env", []):
        source = var.get("valueFrom")
        if source is None:
            env[var["name"]] = expand(var.get("value", ""), env)
        elif "fieldRef" in source:
            assert source["fieldRef"]["fieldPath"] == "status.podIP", var
            env[var["name"]] = POD_IP
        elif "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            env[var["name"]] = secret_value(ref["name"], ref["key"])
        elif "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            env[var["name"]] = named(objs, "ConfigMap", ref["name"])["data"][ref["key"]]
        else:
            raise AssertionError(f"unexpected env source {var}")
    return env


def start_env(ctr: Obj, env: dict[str, str]) -> dict[str, str]:
    """What the container's own command adds before `kvhandoff` starts (the ascend overlay
    exports the transport hostname); run by bash with the pod's environment."""
    command = ctr.get("command")
    if not command:
        return env
    assert command[:2] == ["/bin/bash", "-c"], command
    exports = [part.strip() for part in command[2].split("&&") if "export " in part]
    script = "; ".join([*exports, "env -0"])
    done = subprocess.run(
        ["bash", "-c", script],
        env={**env, "ASCEND_VISIBLE_DEVICES": NPU_ID, "PATH": os.environ["PATH"]},
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    started = dict(env)
    for item in done.stdout.split("\0"):
        key, _, value = item.partition("=")
        if key.startswith("KVHANDOFF_"):
            started[key] = value
    return started


def config_text(objs: list[Obj], workload: Obj) -> str:
    """The TOML the container's `--config` names, from the ConfigMap mounted there."""
    ctr = container(workload)
    args = ctr["args"]
    assert args[:2] == ["serve", "--config"], args
    path = Path(args[2])
    mounts = {m["mountPath"]: m["name"] for m in ctr["volumeMounts"]}
    volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
    source = volumes[mounts[str(path.parent)]]["configMap"]
    key = next(i["key"] for i in source["items"] if i["path"] == path.name)
    text: str = named(objs, "ConfigMap", source["name"])["data"][key]
    return text


@functools.cache
def _load(text: str, env: tuple[tuple[str, str], ...]) -> Config:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.toml"
        path.write_text(text)
        return load_config(path, dict(env))


def service_env(objs: list[Obj], workload: Obj) -> dict[str, str]:
    ctr = container(workload)
    return start_env(ctr, pod_env(objs, workload, ctr))


def service_config(objs: list[Obj], workload: Obj) -> Config:
    env = service_env(objs, workload)
    kv = tuple(sorted((k, v) for k, v in env.items() if k.startswith("KVHANDOFF_")))
    return _load(config_text(objs, workload), kv)


# -- the promises, one function per promise (each raises AssertionError) -----------------------


def port_number(ctr: Obj, port: int | str) -> int:
    if isinstance(port, int):
        return port
    found = [p["containerPort"] for p in ctr.get("ports", []) if p.get("name") == port]
    assert len(found) == 1, f"port {port!r} is not declared once"
    return int(found[0])


def check_probes(objs: list[Obj], workload: Obj) -> None:
    config = service_config(objs, workload)
    ctr = container(workload)
    expected = {
        "startupProbe": "/healthz",
        "livenessProbe": "/healthz",
        "readinessProbe": "/readyz",
    }
    for probe, path in expected.items():
        get = ctr[probe]["httpGet"]
        assert get["path"] == path, (probe, get)
        assert port_number(ctr, get["port"]) == config.server.port, (probe, get)
        assert get.get("scheme", "HTTP") == "HTTP"
    # The startup probe lets start-up take as long as compose's start_period (60 s) at least.
    startup = ctr["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 60


def check_service_and_scrape(objs: list[Obj], workload: Obj) -> None:
    config = service_config(objs, workload)
    template = workload["spec"]["template"]
    service = named(objs, "Service", workload["spec"]["serviceName"])
    assert service["spec"].get("clusterIP") == "None", "routers address pods: headless"
    assert selects(service["spec"]["selector"], template["metadata"]["labels"])
    # It selects this workload's pods only (a stage's Service must not list another stage).
    for other in workloads(objs):
        if other is not workload:
            labels = other["spec"]["template"]["metadata"]["labels"]
            assert not selects(service["spec"]["selector"], labels), other["metadata"]["name"]
    (port,) = service["spec"]["ports"]
    assert port["name"] == "http" and port["port"] == config.server.port
    assert port_number(container(workload), port["targetPort"]) == config.server.port
    notes = template["metadata"].get("annotations", {})
    assert notes.get("prometheus.io/scrape") == "true"
    assert notes.get("prometheus.io/port") == str(config.server.port)
    assert notes.get("prometheus.io/path") == "/metrics"


def mooncake_range(objs: list[Obj], workload: Obj) -> tuple[int, int]:
    env = service_env(objs, workload)
    low, high = int(env["MC_MIN_RPC_PORT"]), int(env["MC_MAX_RPC_PORT"])
    assert 1024 < low <= high < 65536, (low, high)
    return low, high


def check_mooncake_ports(objs: list[Obj], workload: Obj) -> None:
    config = service_config(objs, workload)
    low, high = mooncake_range(objs, workload)
    declared = {
        p["containerPort"] for p in container(workload)["ports"] if p["name"].startswith("mooncake")
    }
    assert declared == set(range(low, high + 1)), (sorted(declared), low, high)
    assert not low <= config.server.port <= high, "the HTTP port is inside Mooncake's range"


def check_pod_ip_urls(objs: list[Obj], workload: Obj) -> None:
    config = service_config(objs, workload)
    assert config.server.public_url == f"http://{POD_IP}:{config.server.port}", (
        "public_url is not the pod IP (is POD_IP defined before the variables using it?)",
        config.server.public_url,
    )
    assert config.transport.hostname.split(":")[0] == POD_IP, config.transport.hostname
    if config.transport.protocol == "ascend":
        assert re.fullmatch(rf"{POD_IP}:\d+:npu_{NPU_ID}", config.transport.hostname)
    if config.role == "decode":
        # Routers name the prefill pods of each handoff; a static list would be stale.
        assert config.peers.prefill == []


def check_secrets(objs: list[Obj], workload: Obj) -> None:
    config = service_config(objs, workload)
    assert not of_kind(objs, "Secret"), "no secret values ship with the manifests"
    refs: dict[str, str] = {}
    for ctr in workload["spec"]["template"]["spec"]["containers"]:
        for var in ctr.get("env", []):
            if var["name"].startswith(("KVHANDOFF_AUTH__", "KVHANDOFF_SERVER__TOKEN")):
                assert "value" not in var, f"{var['name']} is written in the manifest"
                ref = var["valueFrom"]["secretKeyRef"]
                assert not ref.get("optional", False), f"{var['name']}: optional secret"
                if ctr["name"] == "kvhandoff":
                    refs[var["name"].removeprefix("KVHANDOFF_AUTH__").lower()] = ref["name"]
    assert set(refs) == ROLE_SECRETS[config.role], refs
    assert len(set(refs.values())) == len(refs), f"one Secret per role: {refs}"
    for role in ROLE_SECRETS[config.role]:
        assert config.secrets(role) == (secret_value(refs[role], "secret"),), role


def check_grace_period(objs: list[Obj], workload: Obj) -> None:
    config = service_config(objs, workload)
    bound_s = SHUTDOWN_TIMEOUT_S + config.handoff.shutdown_grace_s
    grace = workload["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace >= 2 * bound_s, (grace, bound_s)


def check_security(objs: list[Obj], workload: Obj, overlay: str) -> None:
    pod = workload["spec"]["template"]["spec"]
    ctr = container(workload)
    security = {**pod.get("securityContext", {}), **ctr.get("securityContext", {})}
    assert security.get("allowPrivilegeEscalation") is False
    assert not security.get("privileged", False)
    if overlay not in ROOT_USER:
        assert security.get("runAsNonRoot") is True and security.get("runAsUser", 0) > 0
        assert security["capabilities"]["drop"] == ["ALL"]
        assert not security["capabilities"].get("add")
    if overlay not in WRITABLE_ROOT:
        assert security.get("readOnlyRootFilesystem") is True
    assert pod.get("automountServiceAccountToken") is False


def check_state_volume(objs: list[Obj], workload: Obj) -> None:
    config = service_config(objs, workload)
    mounts = {m["mountPath"]: m["name"] for m in container(workload)["volumeMounts"]}
    assert config.server.state_dir in mounts, "server.state_dir is not a volume"
    name = mounts[config.server.state_dir]
    claims = [c["metadata"]["name"] for c in workload["spec"].get("volumeClaimTemplates", [])]
    if config.role == "decode":
        # Records and the webhook outbox must outlive the pod.
        assert workload["kind"] == "StatefulSet" and name in claims, (name, claims)
    else:
        volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
        assert name in claims or name in volumes


def check_network_policy(objs: list[Obj], workload: Obj) -> None:
    config = service_config(objs, workload)
    labels = workload["spec"]["template"]["metadata"]["labels"]
    policies = [
        p
        for p in of_kind(objs, "NetworkPolicy")
        if selects(p["spec"]["podSelector"]["matchLabels"], labels)
    ]
    assert len(policies) == 1, f"{len(policies)} NetworkPolicies select {labels}"
    spec = policies[0]["spec"]
    assert spec["policyTypes"] == ["Ingress"]
    low, high = mooncake_range(objs, workload)
    mooncake_admitted = peers_admitted = router_admitted = False
    for rule in spec["ingress"]:
        assert rule.get("from"), "a rule without `from` admits everyone"
        assert rule.get("ports"), "a rule without `ports` admits every port"
        ports = {(p["port"], p.get("endPort", p["port"])) for p in rule["ports"]}
        for peer in rule["from"]:
            assert "ipBlock" not in peer, peer
            if "namespaceSelector" in peer:
                # Other namespaces (the router's, monitoring) reach HTTP only.
                assert ports == {(config.server.port, config.server.port)}, (peer, ports)
                assert "podSelector" not in peer or peer["podSelector"], peer
                names = peer["namespaceSelector"]["matchLabels"]
                router_admitted |= names == {"kubernetes.io/metadata.name": ROUTER_NAMESPACE}
            else:
                assert peer["podSelector"]["matchLabels"], "an empty podSelector is every pod"
        if rule["from"] == [{"podSelector": {"matchLabels": KVHANDOFF_PODS}}]:
            peers_admitted |= (config.server.port, config.server.port) in ports
        if (low, high) in ports:
            mooncake_admitted = True
            assert rule["from"] == [{"podSelector": {"matchLabels": KVHANDOFF_PODS}}], rule
        for start, end in ports:
            overlap = start <= high and end >= low
            assert not overlap or (start, end) == (low, high), (start, end, low, high)
    assert mooncake_admitted, "Mooncake's ports are not admitted from kvhandoff pods"
    assert peers_admitted, "kvhandoff pods cannot reach the HTTP port (peer routes)"
    assert router_admitted, "the router namespace cannot reach the HTTP port"


def check_sidecar(objs: list[Obj], workload: Obj) -> None:
    config = service_config(objs, workload)
    (stage,) = config.stages
    assert stage.pool.startswith("shm:"), stage.pool
    volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
    for name in ("kvhandoff", "engine"):
        mounts = {m["mountPath"]: m["name"] for m in container(workload, name)["volumeMounts"]}
        shm = volumes[mounts["/dev/shm"]]["emptyDir"]
        assert shm["medium"] == "Memory", shm
    layout = embedded_layout(config, stage.pp_rank)
    _, pool_bytes = pack_offsets(layout.region_sizes, config.transport.align_bytes)
    assert quantity_bytes(shm["sizeLimit"]) >= pool_bytes, (shm["sizeLimit"], pool_bytes)


def quantity_bytes(quantity: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
    m = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti)?", quantity)
    assert m, quantity
    return int(m[1]) * units.get(m[2] or "", 1)


CHECKS: dict[str, Callable[[list[Obj], Obj], None]] = {
    "probes": check_probes,
    "service_and_scrape": check_service_and_scrape,
    "mooncake_ports": check_mooncake_ports,
    "pod_ip_urls": check_pod_ip_urls,
    "secrets": check_secrets,
    "grace_period": check_grace_period,
    "state_volume": check_state_volume,
    "network_policy": check_network_policy,
}


def cases() -> Iterator[Any]:
    for overlay in KUSTOMIZATIONS:
        for check in CHECKS:
            yield pytest.param(overlay, check, id=f"{overlay}-{check}")


# -- the tests ---------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", KUSTOMIZATIONS)
def test_renders_a_decode_and_one_workload_per_prefill_stage(overlay: str) -> None:
    objs = render(overlay)
    configs = {w["metadata"]["name"]: service_config(objs, w) for w in workloads(objs)}
    decode = [c for c in configs.values() if c.role == "decode"]
    prefill = [c for c in configs.values() if c.role == "prefill"]
    assert len(decode) == 1 and prefill
    pp_size = prefill[0].pp_size
    ranks = sorted(s.pp_rank for c in prefill for s in c.stages)
    assert ranks == list(range(pp_size)), ranks
    assert all(len(c.stages) == 1 for c in prefill), "one stage per workload"
    for c in prefill:
        assert c.model_spec() == decode[0].model_spec(), "pairing would refuse every handoff"
        assert c.transport.protocol == decode[0].transport.protocol


@pytest.mark.parametrize("overlay", KUSTOMIZATIONS)
def test_every_object_validates_against_the_kubernetes_schemas(overlay: str) -> None:
    for obj in render(overlay):
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize(("overlay", "check"), list(cases()))
def test_rendered_workloads_keep_their_promises(overlay: str, check: str) -> None:
    objs = render(overlay)
    for workload in workloads(objs):
        CHECKS[check](objs, workload)


@pytest.mark.parametrize("overlay", KUSTOMIZATIONS)
def test_pods_are_non_root_with_read_only_roots_unless_the_overlay_says_why(overlay: str) -> None:
    objs = render(overlay)
    for workload in workloads(objs):
        check_security(objs, workload, overlay)


@pytest.mark.parametrize("overlay", KUSTOMIZATIONS)
def test_configmap_configs_pass_serve_check_with_their_pods_environment(
    overlay: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    objs = render(overlay)
    for name in list(os.environ):
        if name.startswith("KVHANDOFF_"):
            monkeypatch.delenv(name)
    for workload in workloads(objs):
        path = tmp_path / f"{workload['metadata']['name']}.toml"
        path.write_text(config_text(objs, workload))
        env = {k: v for k, v in service_env(objs, workload).items() if k.startswith("KVHANDOFF_")}
        with monkeypatch.context() as m:
            for key, value in env.items():
                m.setenv(key, value)
            status = kvhandoff(["serve", "--check", "--config", str(path)])
        assert status == 0, (workload["metadata"]["name"], capsys.readouterr().err)


#: Starts a Transfer Engine as the service does (TCP, P2P handshake) and prints the TCP ports
#: this process listens on, from /proc (the engine's RPC and data listeners).
LISTENING_PORTS = """
import json, os, re
from mooncake.engine import TransferEngine
engine = TransferEngine()
assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
inodes = set()
for fd in os.listdir("/proc/self/fd"):
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except FileNotFoundError:  # the listing's own descriptor, closed since
        continue
    if m := re.fullmatch(r"socket:\\[(\\d+)\\]", target):
        inodes.add(m[1])
ports = set()
for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
    for line in open(table).read().splitlines()[1:]:
        f = line.split()
        if f[3] == "0A" and f[9] in inodes:  # LISTEN
            ports.add(int(f[1].rsplit(":", 1)[1], 16))
print(json.dumps({"rpc": engine.get_rpc_port(), "listening": sorted(ports)}))
"""


def test_mooncake_listens_only_inside_the_declared_range() -> None:
    """The MC_* range in the pods is what the engine itself honours (it is not a kvhandoff
    key): started with the pod's variables, every port it listens on is one the
    NetworkPolicy admits and the pod declares."""
    pytest.importorskip("mooncake.engine")
    objs = render("base")
    workload = _template(objs, "decode")
    low, high = mooncake_range(objs, workload)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MC_")}
    env.update({k: v for k, v in service_env(objs, workload).items() if k.startswith("MC_")})
    done = subprocess.run(
        [sys.executable, "-c", LISTENING_PORTS],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.splitlines()[-1])
    assert len(found["listening"]) >= 2, found  # the handshake and the TCP data listener
    assert found["rpc"] in found["listening"]
    assert all(low <= p <= high for p in found["listening"]), (found, low, high)


def test_sidecar_pods_share_the_engine_kv_through_shared_memory() -> None:
    objs = render("sidecar")
    for workload in workloads(objs):
        check_sidecar(objs, workload)


def test_rdma_pods_get_a_device_ipc_lock_and_the_nic_list() -> None:
    objs = render("rdma")
    for workload in workloads(objs):
        config = service_config(objs, workload)
        assert config.transport.protocol == "rdma" and config.transport.device_name
        ctr = container(workload)
        assert "IPC_LOCK" in ctr["securityContext"]["capabilities"]["add"]
        assert any(r.startswith("rdma/") for r in ctr["resources"]["limits"])


def test_ascend_pods_get_an_npu_the_driver_and_hccn_conf() -> None:
    objs = render("ascend")
    for workload in workloads(objs):
        config = service_config(objs, workload)
        assert config.transport.protocol == "ascend"
        assert all(s.pool.startswith("torch:npu:") for s in config.stages)
        ctr = container(workload)
        assert ctr["image"].endswith(":ascend")
        assert "huawei.com/Ascend910" in ctr["resources"]["limits"]
        mounts = {m["mountPath"]: m for m in ctr["volumeMounts"]}
        for path in ("/etc/hccn.conf", "/usr/local/Ascend/driver"):
            assert mounts[path]["readOnly"] is True, path


def test_grafana_dashboard_configmap_is_the_compose_dashboard() -> None:
    board = named(render("base"), "ConfigMap", "kvhandoff-grafana-dashboard")
    assert board["metadata"]["labels"]["grafana_dashboard"] == "1"
    (text,) = board["data"].values()
    assert text == DASHBOARD.read_text()
    assert isinstance(json.loads(text), dict)


def test_base_configs_differ_from_compose_only_where_a_pod_differs() -> None:
    """The cluster configs are the compose ones minus the compose host names (set from the
    pod instead) and the static prefill list (routers name pods): nothing else drifts."""
    for name in ("decode", "prefill-0", "prefill-1"):
        compose = tomllib.loads((ROOT / "docker" / f"{name}.toml").read_text())
        cluster = tomllib.loads((K8S / "base" / "config" / f"{name}.toml").read_text())
        for table, key in (("server", "public_url"), ("transport", "hostname")):
            assert key not in cluster[table], (name, key)
            compose[table].pop(key)
        compose.get("peers", {}).pop("prefill", None)
        for table in ("role", "model", "partition", "stages"):
            assert cluster.get(table) == compose.get(table), (name, table)
        assert cluster["server"]["port"] == compose["server"]["port"]


# -- every check can fail ----------------------------------------------------------------------


def _template(objs: list[Obj], role: str) -> Obj:
    for workload in workloads(objs):
        if (
            workload["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
            == role
        ):
            return workload
    raise AssertionError(role)


def _env(workload: Obj, name: str) -> Obj:
    return next(v for v in container(workload)["env"] if v["name"] == name)


def _break_probe_port(objs: list[Obj]) -> None:
    _template(objs, "decode")["spec"]["template"]["spec"]["containers"][0]["readinessProbe"][
        "httpGet"
    ]["port"] = 8100


def _break_url_order(objs: list[Obj]) -> None:
    env = container(_template(objs, "prefill"))["env"]
    env.append(env.pop(0))  # POD_IP after its users: $(POD_IP) stays unexpanded


def _break_secret(objs: list[Obj]) -> None:
    var = _env(_template(objs, "prefill"), "KVHANDOFF_AUTH__ENGINE")
    var.pop("valueFrom")
    var["value"] = "hunter2"


def _break_grace(objs: list[Obj]) -> None:
    _template(objs, "decode")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 10


def _break_policy(objs: list[Obj]) -> None:
    policy = named(objs, "NetworkPolicy", "kvhandoff-decode")
    policy["spec"]["ingress"][1]["ports"].append(
        {"protocol": "TCP", "port": 15000, "endPort": 15007}
    )


def _break_peer_policy(objs: list[Obj]) -> None:
    policy = named(objs, "NetworkPolicy", "kvhandoff-prefill")
    policy["spec"]["ingress"][0]["ports"] = [{"protocol": "TCP", "port": 15000, "endPort": 15007}]


def _break_mooncake_range(objs: list[Obj]) -> None:
    _env(_template(objs, "decode"), "MC_MAX_RPC_PORT")["value"] = "17000"


def _break_state(objs: list[Obj]) -> None:
    decode = _template(objs, "decode")
    decode["spec"].pop("volumeClaimTemplates")
    decode["spec"]["template"]["spec"]["volumes"].append({"name": "state", "emptyDir": {}})


def _break_scrape(objs: list[Obj]) -> None:
    template = _template(objs, "prefill")["spec"]["template"]
    template["metadata"]["annotations"]["prometheus.io/port"] = "8200"


PLANTED: dict[str, tuple[Callable[[list[Obj]], None], str]] = {
    "probe on the wrong port": (_break_probe_port, "probes"),
    "POD_IP defined after its users": (_break_url_order, "pod_ip_urls"),
    "a secret written in the manifest": (_break_secret, "secrets"),
    "grace period below twice the bounds": (_break_grace, "grace_period"),
    "Mooncake ports open to the router namespace": (_break_policy, "network_policy"),
    "peer routes unreachable from kvhandoff pods": (_break_peer_policy, "network_policy"),
    "Mooncake range wider than declared": (_break_mooncake_range, "mooncake_ports"),
    "decode state on an emptyDir": (_break_state, "state_volume"),
    "metrics scraped at another port": (_break_scrape, "service_and_scrape"),
}


@pytest.mark.parametrize("planted", PLANTED)
def test_a_planted_bad_object_fails_its_check(planted: str) -> None:
    objs = render("base")
    for workload in workloads(objs):  # the check passes before...
        CHECKS[PLANTED[planted][1]](objs, workload)
    PLANTED[planted][0](objs)
    with pytest.raises(AssertionError):  # ... and fails after
        for workload in workloads(objs):
            CHECKS[PLANTED[planted][1]](objs, workload)


def test_a_planted_writable_root_or_root_user_fails_the_security_check() -> None:
    for field, value in (("readOnlyRootFilesystem", False), ("runAsUser", 0)):
        objs = render("base")
        workload = _template(objs, "decode")
        check_security(objs, workload, "base")
        container(workload)["securityContext"][field] = value
        with pytest.raises(AssertionError):
            check_security(objs, workload, "base")


def test_a_planted_small_shared_memory_volume_fails_the_sidecar_check() -> None:
    objs = render("sidecar")
    workload = _template(objs, "decode")
    check_sidecar(objs, workload)
    volume = next(v for v in workload["spec"]["template"]["spec"]["volumes"] if v["name"] == "shm")
    volume["emptyDir"]["sizeLimit"] = "64Mi"  # the decode pool is 259 MiB
    with pytest.raises(AssertionError, match="64Mi"):
        check_sidecar(objs, workload)


def test_a_planted_unknown_field_fails_schema_validation() -> None:
    objs = render("base")
    workload = _template(objs, "decode")
    container(workload)["readinessProbe"]["httpGet"]["prot"] = 8200
    with pytest.raises(kubernetes_validate.ValidationError, match="'prot' was unexpected"):
        kubernetes_validate.validate(workload, K8S_VERSIONS[0], strict=True)


def test_a_planted_bad_config_fails_serve_check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    objs = render("base")
    text = config_text(objs, _template(objs, "prefill"))
    path = tmp_path / "prefill.toml"
    path.write_text(text.replace("counts = [24, 24]", "counts = [24, 25]"))
    assert kvhandoff(["serve", "--check", "--config", str(path)]) == 2
    assert "partition.counts" in capsys.readouterr().err


def test_a_broken_kustomization_fails_to_render(tmp_path: Path) -> None:
    shutil.copytree(K8S, tmp_path / "k8s")
    (tmp_path / "k8s" / "base" / "config" / "decode.toml").unlink()
    done = subprocess.run(
        [kubectl(), "kustomize", str(tmp_path / "k8s" / "overlays" / "sidecar")],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert done.returncode != 0 and "decode.toml" in done.stderr
