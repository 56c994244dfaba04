"""The service's configuration: one frozen Struct tree, parsed once at start-up and passed down.

`load_config(path, env, overrides)` merges, lowest precedence first: defaults, the TOML file,
`KVHANDOFF_<SECTION>__<KEY>` environment variables, and CLI overrides; then converts the result
with msgspec (unknown keys rejected) and checks what spans several keys. Every error is a
`ConfigError` whose `field` (and message prefix) is the TOML key path, e.g.
`stages[1].pp_rank: 4 is not below pp_size 4`.

Only `kvhandoff.service.serve` passes `os.environ` in; nothing else in the codebase reads it.
"""

from __future__ import annotations

import json
import re
import tomllib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

import msgspec
from msgspec import Meta, Struct, field
from msgspec.structs import force_setattr

from kvhandoff.pipelines.errors import InvalidInput, LayoutError
from kvhandoff.pipelines.events import REPLAY
from kvhandoff.pipelines.models import PRESETS, ModelSpec, Partition, partition_layers, preset
from kvhandoff.pipelines.settings import (
    DECODE_DEFAULTS,
    PREFILL_DEFAULTS,
    DecodeSettings,
    PrefillSettings,
)
from kvhandoff.pipelines.urls import canonical_url
from kvhandoff.transport.config import MooncakeConfig
from kvhandoff.transport.local import LocalConfig

ENV_PREFIX = "KVHANDOFF_"
MiB = 1 << 20

Role = Literal["prefill", "decode"]
LogLevel = Literal["debug", "info", "warning", "error"]
Port = Annotated[int, Meta(ge=0, le=65535)]
Positive = Annotated[int, Meta(gt=0)]
NonNeg = Annotated[int, Meta(ge=0)]
PositiveSeconds = Annotated[float, Meta(gt=0)]

# torch:cpu, torch:cuda, torch:cuda:0, torch:npu:3, shm:<name> (a file name under /dev/shm)
_WHSEC = re.compile(r"^whsec_[A-Za-z0-9+/]{16,}={0,2}$")
_POOL_SPEC = re.compile(r"^(torch:(cpu|(cuda|npu)(:\d+)?)|shm:[A-Za-z0-9._-]+)$")


class ConfigError(InvalidInput):
    """The configuration is invalid; `field` is the TOML key path (or the environment variable)."""

    code = "config_error"

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}" if path else message, field=path or None)


class ServerConfig(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    host: str = "127.0.0.1"
    port: Port = 8100
    #: How peers and webhooks reach this service; derived from host and port when empty. Set it
    #: when binding to 0.0.0.0 or behind NAT/containers, where host is not a reachable name.
    public_url: str = ""
    #: One shared secret for every role whose `[auth]` key is unset (router and engine bearer
    #: token, peer signing key). Alone it separates no roles: prefer `[auth]`.
    token: str | None = None
    max_body_bytes: Positive = 8 * MiB
    #: Webhook outbox and other persistent state; default $XDG_STATE_HOME/kvhandoff.
    state_dir: str = ""
    log_level: LogLevel = "info"
    #: Origins allowed to read the SSE stream from a browser page elsewhere ("*": any).
    cors_origins: list[str] = []

    def __post_init__(self) -> None:
        if not self.public_url:
            # Frozen: the derived default is filled in once, here, so readers never derive it.
            force_setattr(self, "public_url", f"http://{self.host}:{self.port}")
        self_url = canonical_url(self.public_url)  # the one form every URL is compared in
        if self_url != self.public_url:
            force_setattr(self, "public_url", self_url)

    @property
    def state_path(self) -> Path:
        return Path(self.state_dir)


#: One secret, or several: the first is current (peers sign with it), all are accepted (rotation).
Secrets = str | list[Annotated[str, Meta(min_length=1)]]
AUTH_ROLES = ("router", "engine", "peer")


class AuthConfig(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Credentials per role (docs/operations/security.md); a role left unset falls back on
    `server.token`, and a role with neither is open. No secret may serve two roles."""

    #: Bearer tokens of routers: create/get/list/abort handoffs, validate, events, webhooks.
    router: Secrets | None = None
    #: Bearer tokens of engines: stage ready.
    engine: Secrets | None = None
    #: HMAC-SHA256 keys of peer services: every `/v1/peer/*` call and `GET /v1/layout` is signed.
    peer: Secrets | None = None
    #: A signed peer message older or newer than this is refused (clock skew plus transit).
    max_skew_s: PositiveSeconds = 30.0
    #: Nonces remembered to refuse replays; beyond it the oldest go and older messages are refused.
    replay_cache: Positive = 65536

    def __post_init__(self) -> None:
        for role in AUTH_ROLES:
            value = getattr(self, role)
            if isinstance(value, str):
                force_setattr(self, role, [value])
            elif value is not None and not value:
                raise ValueError(f"auth.{role}: give at least one secret, or leave it unset")


#: The `[transport]` section: one Struct per backend, told apart by its `backend` key (a missing
#: one means "mooncake", so configurations written before the union keep working). A backend's
#: own settings are reached through its type (`isinstance(config.transport, MooncakeConfig)`);
#: `align_bytes`, `max_call_s` and the two batch caps every backend has.
#: "mooncake": the Transfer Engine (`kvhandoff.transport.config.MooncakeConfig`); "local":
#: in-process memmove for single-process use and benchmarks
#: (`kvhandoff.transport.local.LocalConfig`).
TransportConfig = MooncakeConfig | LocalConfig
DEFAULT_BACKEND = "mooncake"


def backend_of(transport: TransportConfig) -> str:
    """The `backend` key `transport` was given (or defaulted to)."""
    return str(type(transport).__struct_config__.tag)


def transport_backends() -> dict[str, type[TransportConfig]]:
    """Each backend's config Struct by its `backend` key."""
    return {str(t.__struct_config__.tag): t for t in get_args(TransportConfig)}


class TransferConfig(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """How bytes reach decode memory (`docs/concepts/safety.md`).

    `landed` (default): prefills write only into windows of the decode's landing arena; the
    decode copies each segment into its KV pages itself and counts it only once the digest of
    the pages it wrote matches, so no stale or forged write reaches a page of a completed
    handoff or of another handoff. `direct`: prefills write straight into the KV pages (no
    landing memory, one copy fewer), safe only as long as the timing bound holds, like SGLang
    and vLLM."""

    mode: Literal["landed", "direct"] = "landed"
    #: Decode: the landing arena, registered beside the KV pool on its device.
    landing_bytes: Positive = 128 * MiB
    #: Decode: the largest window one segment is granted (a page of one layer must fit).
    window_bytes: Positive = 16 * MiB
    #: Prefill: the staging buffer segments are packed into before they travel.
    staging_bytes: Positive = 64 * MiB
    #: Decode: the share of the arena the windows of one prefill service may take, held or
    #: quarantined (at least one window), so a hung prefill cannot starve the others; 1.0 where
    #: a decode has a single prefill service.
    peer_share: Annotated[float, Meta(gt=0, le=1)] = 0.5


class ModelConfig(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A preset (see `kvhandoff.pipelines.models.PRESETS`) with overrides, or an explicit `spec`
    table."""

    preset: str | None = None
    scale: Positive | None = None
    num_layers: Positive | None = None
    page_size: Positive | None = None
    indexer: bool | None = None
    spec: ModelSpec | None = None

    def build(self) -> ModelSpec:
        """The ModelSpec this section describes; raises ConfigError naming the key."""
        overrides = {
            k: v
            for k, v in (
                ("scale", self.scale),
                ("num_layers", self.num_layers),
                ("page_size", self.page_size),
                ("indexer", self.indexer),
            )
            if v is not None
        }
        if self.spec is not None:
            if self.preset is not None or overrides:
                raise ConfigError("model.spec", "give either a preset (with overrides) or a spec")
            return self.spec
        if self.preset is None:
            raise ConfigError("model.preset", f"required; one of {', '.join(sorted(PRESETS))}")
        if self.preset not in PRESETS:
            raise ConfigError(
                "model.preset", f"unknown preset {self.preset!r}; one of {', '.join(PRESETS)}"
            )
        try:
            return preset(self.preset, **overrides)
        except TypeError:  # an override this preset's factory does not take (e.g. indexer)
            raise ConfigError(
                "model.indexer", f"preset {self.preset!r} does not take this override"
            ) from None


class PartitionConfig(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """How the model's layers split over PP stages; even split (vLLM's rule) when both unset."""

    counts: list[Positive] | None = None
    boundaries: list[Positive] | None = None


#: The pipelines' own defaults: the knobs below that set them take their defaults from here.
_DECODE = DECODE_DEFAULTS
_PREFILL = PREFILL_DEFAULTS


class HandoffConfig(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    default_deadline_s: PositiveSeconds = _DECODE.default_deadline_s
    heartbeat_interval_s: PositiveSeconds = 1.0
    #: A peer silent for this long fails its handoffs.
    peer_timeout_s: PositiveSeconds = 3.0
    #: Default of a handoff's `verify`: each stage sends a digest of the bytes it wrote, and the
    #: decode compares it with what landed before it completes the handoff (costs a read of both).
    verify: bool = _DECODE.verify_default
    max_concurrent: Positive = _DECODE.max_live
    #: Decode role: the most it waits, past a handoff's deadline, for a prefill writer that did
    #: not confirm it stopped (each prefill declares its own engine-call bound; one above this
    #: is refused at create). Pages stay leased until then.
    max_grace_s: PositiveSeconds = _DECODE.max_grace_s
    #: Decode role: the largest `metadata` a create may carry, as JSON bytes (it is echoed in
    #: every event, record and webhook of the handoff); a larger one is refused with 422.
    max_metadata_bytes: Positive = 16384
    #: How long a stopping decode service waits for its handoffs' pages to be released (its
    #: prefill stages confirming they stopped) before it closes its transport anyway — after
    #: which no write can land — leaving what is unreleased fenced in its records.
    shutdown_grace_s: PositiveSeconds = 5.0
    #: Events kept for SSE `Last-Event-ID` resume.
    sse_buffer: Positive = REPLAY
    #: Seconds between SSE keep-alive comments (proxies close idle streams).
    sse_keepalive_s: PositiveSeconds = 15.0
    #: Events one SSE subscriber may fall behind before it is dropped with `stream.overflow`.
    sse_queue: Positive = 1024

    def decode_settings(self) -> DecodeSettings:
        """The decode pipeline's settings from this section (its other knobs at their default)."""
        return msgspec.structs.replace(
            _DECODE,
            default_deadline_s=self.default_deadline_s,
            max_live=self.max_concurrent,
            verify_default=self.verify,
            # After the deadline no prefill batch starts; one started ends within what its
            # prefill declared, which may not exceed this.
            max_grace_s=self.max_grace_s,
        )


class RecordsConfig(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Decode role: handoff records and the webhook outbox in SQLite under `server.state_dir`."""

    #: Keep every accepted handoff and its terminal state across restarts (and feed webhooks).
    persist: bool = True
    #: Terminal records (and finished deliveries) older than this are deleted.
    retention_s: PositiveSeconds = 7 * 86400.0
    #: At most this many terminal records are kept (the oldest go first).
    max_records: Positive = 100_000


class WebhooksConfig(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Delivery of events to registered endpoints (Standard Webhooks), from the outbox."""

    #: Hosts webhooks may target; empty: any. ".example.com" also admits its subdomains.
    allow_hosts: list[str] = []
    #: Admit loopback, private, link-local and other non-public addresses (tests, one machine).
    allow_private: bool = False
    #: Signs deliveries to a handoff's `callback_url` ("whsec_..."); unset: callback_url refused.
    callback_secret: str | None = None
    #: Event type prefixes a `callback_url` receives.
    callback_types: list[str] = field(default_factory=lambda: ["handoff."])
    #: One attempt's limit (connect + response).
    timeout_s: PositiveSeconds = 10.0
    #: A delivery is given up after this many attempts or this age, whichever comes first.
    max_attempts: Positive = 12
    max_age_s: PositiveSeconds = 86400.0
    #: Retry delays: full jitter over min(max, base * 2**attempt); Retry-After wins when longer.
    backoff_base_s: PositiveSeconds = 0.5
    backoff_max_s: PositiveSeconds = 300.0
    #: Deliveries in flight to one endpoint; the events of one handoff always go one at a time.
    concurrency: Positive = 8
    #: Deliveries of one endpoint held in memory; beyond it they wait in the outbox (committed
    #: already) and are loaded, oldest first, as the held ones end. Bounds a dead endpoint's cost.
    max_held: Positive = 10000


class PeersConfig(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    #: Decode role: prefill services to send destinations to when a request names none.
    prefill: list[str] = []

    def __post_init__(self) -> None:
        canonical = [canonical_url(u) for u in self.prefill]
        if canonical != self.prefill:  # compared with senders' public_url in this form
            force_setattr(self, "prefill", canonical)

    #: Default timeout of one service-to-service call; keep it at or above
    #: `handoff.peer_timeout_s`, or a call gives up on a peer the heartbeats still count alive
    #: (`serve` warns at start-up).
    request_timeout_s: PositiveSeconds = 5.0
    #: Send the hot peer calls (destinations, aborts, arrivals, failures, windows, segments) on
    #: one persistent, per-frame authenticated channel per peer life (`/v1/peer/channel`)
    #: instead of one HTTP request each; off: every call is an HTTP request.
    channels: bool = True
    #: Peer health (`/metrics` labels, the dashboard) forgets a peer that is neither configured
    #: (`prefill`) nor sharing live handoffs once it has been idle — not heard, nothing shared
    #: — for this long.
    forget_after_s: PositiveSeconds = 600.0
    #: At most this many peers in the health table: beyond it, the unpinned ones idle longest
    #: are forgotten first (configured peers and peers with live handoffs always stay).
    max_tracked: Positive = 256
    #: A peer's watch stream that is refused (e.g. 404 from an older version, 401/403) or ends
    #: at once is retried after an exponential backoff from this step (jittered down to half)...
    watch_retry_min_s: PositiveSeconds = 0.5
    #: ... up to this one; a stream that stayed open a heartbeat interval resets it.
    watch_retry_max_s: PositiveSeconds = 30.0


class StageConfig(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    pp_rank: NonNeg = 0
    pp_size: Positive = 1
    num_pages: Positive
    #: Linear-attention state slots and aux rows (requests in flight); ignored by models
    #: without either.
    num_slots: NonNeg = 0
    #: "torch:cpu", "torch:cuda:0", "torch:npu:0" or "shm:<name>" (see kvhandoff.transport.pools).
    pool: str = "torch:cpu"


class Config(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    role: Role
    server: ServerConfig = field(default_factory=ServerConfig)
    transport: TransportConfig = field(default_factory=MooncakeConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    #: Required unless an embedding engine hands over every stage's layout with its buffers
    #: (`kvhandoff.service.runtime.stages.EngineStage`, as the SGLang backend does).
    model: ModelConfig | None = None
    partition: PartitionConfig = field(default_factory=PartitionConfig)
    handoff: HandoffConfig = field(default_factory=HandoffConfig)
    peers: PeersConfig = field(default_factory=PeersConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    records: RecordsConfig = field(default_factory=RecordsConfig)
    webhooks: WebhooksConfig = field(default_factory=WebhooksConfig)
    stages: list[StageConfig]

    def secrets(self, role: str) -> tuple[str, ...]:
        """The secrets of `role` ("router", "engine", "peer"), current first; () when open."""
        explicit = getattr(self.auth, role)
        if explicit is not None:
            return tuple(explicit)
        return (self.server.token,) if self.server.token else ()

    def model_spec(self) -> ModelSpec:
        if self.model is None:
            raise ConfigError(
                "model", "required (a [model] table), unless the engine hands over its layouts"
            )
        return self.model.build()

    def prefill_settings(self) -> PrefillSettings:
        """The prefill pipeline's settings from this configuration."""
        return msgspec.structs.replace(
            _PREFILL,
            default_deadline_s=self.handoff.default_deadline_s,
            max_blocks_per_batch=self.transport.max_blocks_per_batch,
        )

    @property
    def pp_size(self) -> int:
        return self.stages[0].pp_size

    def layer_partition(self) -> Partition:
        """The PP partition of the model (pp_size 1 on the decode role)."""
        spec = self.model_spec()
        try:
            return partition_layers(
                spec.num_layers,
                self.pp_size,
                counts=self.partition.counts,
                boundaries=self.partition.boundaries,
            )
        except LayoutError as exc:
            raise ConfigError(
                f"partition.{exc.context.get('field', 'counts')}", exc.message
            ) from None


# ---------------------------------------------------------------------------------------------
# Loading


def load_config(
    path: str | Path | None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """Parse and validate the configuration: defaults < TOML file < env < overrides.

    `env` is an environment mapping (only `KVHANDOFF_*` keys are read; an unknown one is an
    error); `overrides` maps dotted key paths (`"server.port"`) or nested dicts to values.
    """
    env = env or {}
    merged: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as f:
                _merge(merged, tomllib.load(f))
        except OSError as exc:
            raise ConfigError("", f"cannot read config file {path}: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError("", f"{path} is not valid TOML: {exc}") from None
    _merge(merged, env_overrides(env))
    for key, value in (overrides or {}).items():
        _merge(merged, _nest(key.split("."), value))
    transport = merged.get("transport")
    if isinstance(transport, dict):
        transport.setdefault("backend", DEFAULT_BACKEND)
    server = merged.setdefault("server", {})
    if isinstance(server, dict) and not server.get("state_dir"):
        server["state_dir"] = str(default_state_dir(env))
    elif isinstance(server, dict):
        server["state_dir"] = _expand_home(str(server["state_dir"]), env)
    try:
        config = msgspec.convert(merged, Config, strict=False)
    except msgspec.ValidationError as exc:
        path, message = _split_msgspec_error(str(exc))
        own = re.match(r"^(auth\.\w+): (.*)$", message)  # AuthConfig names its own key
        if own:
            path, message = own.groups()
        elif path.startswith("transport."):
            message = _transport_message(path, message, merged["transport"]["backend"])
        raise ConfigError(path, message) from None
    except (LayoutError, ValueError) as exc:  # a nested Struct's own __post_init__ (ModelSpec)
        raise ConfigError("model.spec", str(exc)) from None
    check(config)
    return config


def _transport_message(path: str, message: str, backend: Any) -> str:
    """A `[transport]` error names the backend it was read for, and the backends there are."""
    backends = transport_backends()
    if path == "transport.backend":
        return f"{backend!r} is not a transport backend; one of {', '.join(map(repr, backends))}"
    key = path.removeprefix("transport.").split(".")[0]
    if message == "unknown key":
        owners = [name for name, t in backends.items() if key in t.__struct_fields__]
        if owners:
            return f"not a setting of backend {backend!r} (only of {', '.join(owners)})"
    return f"{message} (backend {backend!r})"


def advisories(config: Config) -> list[str]:
    """Settings that are valid each on its own but contradict each other in a way that fails
    live handoffs: `serve` logs each as a warning at start-up and `serve --check` prints them."""
    found = []
    call_s, silence_s = config.peers.request_timeout_s, config.handoff.peer_timeout_s
    if call_s < silence_s:
        # The heartbeats keep a peer alive through `silence_s` of silence, but one call to it
        # gives up after `call_s`: a peer stalled in between fails its live handoffs with
        # peer_timeout although the heartbeats never declared it lost.
        found.append(
            f"peers.request_timeout_s: {call_s:g} s is below handoff.peer_timeout_s "
            f"{silence_s:g} s: a call gives up on a peer the heartbeats still count alive and "
            "fails its handoffs (peer_timeout); set it at or above handoff.peer_timeout_s"
        )
    return found


def check(config: Config) -> None:
    """Cross-key checks that single-field types cannot express."""
    stages = config.stages
    if not stages:
        raise ConfigError("stages", "at least one stage is required")
    if config.role == "decode" and (
        len(stages) != 1 or stages[0].pp_rank != 0 or stages[0].pp_size != 1
    ):
        raise ConfigError("stages", "the decode role hosts exactly one stage: pp_rank 0, pp_size 1")
    seen: dict[int, int] = {}
    for i, stage in enumerate(stages):
        key = f"stages[{i}]"
        if stage.pp_size != stages[0].pp_size:
            raise ConfigError(
                f"{key}.pp_size",
                f"{stage.pp_size} differs from stages[0].pp_size {stages[0].pp_size}",
            )
        if stage.pp_rank >= stage.pp_size:
            raise ConfigError(
                f"{key}.pp_rank", f"{stage.pp_rank} is not below pp_size {stage.pp_size}"
            )
        if stage.pp_rank in seen:
            raise ConfigError(
                f"{key}.pp_rank", f"{stage.pp_rank} is also stages[{seen[stage.pp_rank]}].pp_rank"
            )
        seen[stage.pp_rank] = i
        if not _POOL_SPEC.match(stage.pool):
            raise ConfigError(
                f"{key}.pool",
                f"{stage.pool!r} is not torch:cpu, torch:cuda[:N], torch:npu[:N] or shm:<name>",
            )
    if config.model is not None:  # else the layouts come with the engine's buffers, at start-up
        _check_model(config)
    _check_links(config)
    _check_roles_apart(config)


def _check_model(config: Config) -> None:
    stages = config.stages
    spec = config.model_spec()
    if (spec.state_kinds or spec.aux_row_bytes) and any(s.num_slots == 0 for s in stages):
        bad = next(i for i, s in enumerate(stages) if s.num_slots == 0)
        raise ConfigError(
            f"stages[{bad}].num_slots",
            f"model {spec.name} has state or aux rows (one per slot); must be > 0",
        )
    if config.role == "prefill":
        config.layer_partition()


def _check_links(config: Config) -> None:
    secret = config.webhooks.callback_secret
    if secret is not None and not _WHSEC.match(secret):
        raise ConfigError("webhooks.callback_secret", "must be whsec_ followed by base64")
    for i, url in enumerate(config.peers.prefill):
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"peers.prefill[{i}]", f"{url!r} is not an http(s) URL")
    if config.peers.watch_retry_max_s < config.peers.watch_retry_min_s:
        raise ConfigError(
            "peers.watch_retry_max_s",
            f"{config.peers.watch_retry_max_s:g} is below peers.watch_retry_min_s "
            f"{config.peers.watch_retry_min_s:g}",
        )


def _check_roles_apart(config: Config) -> None:
    """A secret valid for two roles would let one act as the other. Only the legacy setup where
    every role falls back on `server.token` shares one (and separates nothing, as documented)."""
    for i, a in enumerate(AUTH_ROLES):
        for b in AUTH_ROLES[i + 1 :]:
            if getattr(config.auth, a) is None and getattr(config.auth, b) is None:
                continue
            shared = set(config.secrets(a)) & set(config.secrets(b))
            if shared:
                where = b if getattr(config.auth, b) is not None else a
                raise ConfigError(
                    f"auth.{where}",
                    f"a secret of {b} is also one of {a}; one role's credential must not act "
                    "as another's",
                )


def env_overrides(env: Mapping[str, str]) -> dict[str, Any]:
    """`KVHANDOFF_SERVER__PORT=8200` → {"server": {"port": "8200"}} (typed later by msgspec).

    Values starting with `[` or `{` are parsed as JSON (lists, tables). Keys are checked against
    the Config tree here so a typo names the variable, not just the key.
    """
    out: dict[str, Any] = {}
    for name, raw in env.items():
        if not name.startswith(ENV_PREFIX):
            continue
        parts = [p.lower() for p in name[len(ENV_PREFIX) :].split("__")]
        _check_env_key(name, parts)
        value: Any = raw
        if raw.lstrip().startswith(("[", "{")):
            try:
                value = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise ConfigError(name, f"not valid JSON: {exc}") from None
        _merge(out, _nest(parts, value))
    return out


def default_state_dir(env: Mapping[str, str]) -> Path:
    if env.get("XDG_STATE_HOME"):
        return Path(env["XDG_STATE_HOME"]) / "kvhandoff"
    if env.get("HOME"):
        return Path(env["HOME"]) / ".local" / "state" / "kvhandoff"
    return Path.cwd() / ".kvhandoff-state"


def _expand_home(path: str, env: Mapping[str, str]) -> str:
    if path.startswith("~/") and env.get("HOME"):
        return str(Path(env["HOME"]) / path[2:])
    return path


def _check_env_key(name: str, parts: list[str]) -> None:
    fields = _section_fields(Config)
    for depth, part in enumerate(parts):
        if fields is None or part not in fields:
            raise ConfigError(name, f"unknown key {'.'.join(parts[: depth + 1])!r}")
        inner = _section_fields(fields[part])
        if inner is None:
            if depth != len(parts) - 1:
                raise ConfigError(name, f"{'.'.join(parts[: depth + 1])} takes a JSON value")
            return
        fields = inner
    raise ConfigError(name, f"{'.'.join(parts)} is a section; name one of its keys")


def _section_fields(annotation: Any) -> dict[str, Any] | None:
    """The keys of the section `annotation` opens, with their types: a Struct's fields; `X |
    None` as `X` (an optional section, e.g. `model`, still takes its keys from the environment);
    a tagged union of Structs (`transport`) as every member's fields and the tag. None when
    `annotation` is not a section."""
    members = [annotation]
    if get_origin(annotation) in (typing.Union, types.UnionType):
        members = [a for a in get_args(annotation) if a is not type(None)]
    if not all(isinstance(m, type) and issubclass(m, Struct) for m in members):
        return None
    out: dict[str, Any] = {}
    for member in members:
        tag = member.__struct_config__
        if len(members) > 1 and tag.tag_field is not None:
            out[tag.tag_field] = Literal[tuple(t.__struct_config__.tag for t in members)]
        out.update({f.name: f.type for f in msgspec.structs.fields(member)})
    return out


def _nest(parts: list[str], value: Any) -> dict[str, Any]:
    for part in reversed(parts[1:]):
        value = {part: value}
    return {parts[0]: value}


def _merge(into: dict[str, Any], new: Mapping[str, Any]) -> None:
    """Deep-merge tables; anything else (scalars, lists) in `new` replaces."""
    for key, value in new.items():
        if isinstance(value, Mapping) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        elif isinstance(value, Mapping):
            into[key] = {}
            _merge(into[key], value)
        else:
            into[key] = value


_AT = re.compile(r"^(?P<msg>.*) - at `\$(?P<path>[^`]*)`$", re.S)
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<key>[^`]*)`$")
_MISSING = re.compile(r"^Object missing required field `(?P<key>[^`]*)`$")


def _split_msgspec_error(text: str) -> tuple[str, str]:
    """msgspec's "msg - at `$.a.b[1]`" → ("a.b[1]", msg), naming unknown/missing keys fully."""
    m = _AT.match(text)
    path, msg = (m["path"].lstrip("."), m["msg"]) if m else ("", text)
    for pattern, what in ((_UNKNOWN, "unknown key"), (_MISSING, "required key is missing")):
        k = pattern.match(msg)
        if k:
            return (f"{path}.{k['key']}" if path else k["key"]), what
    if msg.startswith("Invalid enum value"):
        choices = get_args(_type_at(path))  # msgspec does not list a Literal's values
        if choices:
            msg += f"; one of {', '.join(repr(c) for c in choices)}"
    return path, msg


def _type_at(path: str) -> Any:
    """The annotated type at a key path like `stages[0].pool` (None if not a plain path)."""
    current: Any = Config
    for part in re.sub(r"\[\d+\]", "", path).split("."):
        while get_origin(current) is list:
            current = get_args(current)[0]
        fields = _section_fields(current)
        if fields is None:
            return None
        current = fields.get(part)
    return current
