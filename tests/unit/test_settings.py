"""Settings have one home: a default is written once, in the settings struct of its layer.

The configuration (`kvhandoff.service.config`) holds the defaults of what a deployment sets; the
pipelines' settings (`kvhandoff.pipelines.settings`) hold theirs, which the configuration reuses. A
constructor takes its settings struct instead of repeating a default as a literal: the check
below walks every signature in the tree and refuses a numeric literal default for a parameter
named like a setting (or known to be one under another name).
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import msgspec
import pytest

from kvhandoff.pipelines.decode import DecodePipeline
from kvhandoff.pipelines.prefill import PrefillPipeline
from kvhandoff.pipelines.settings import (
    DECODE_DEFAULTS,
    PREFILL_DEFAULTS,
    DecodeSettings,
    PrefillSettings,
)
from kvhandoff.service.config import (
    AuthConfig,
    Config,
    HandoffConfig,
    PeersConfig,
    RecordsConfig,
    TransferConfig,
    WebhooksConfig,
    load_config,
)
from kvhandoff.service.peers.heartbeat import Heartbeats, HeartbeatSettings
from kvhandoff.transport.config import MooncakeConfig
from kvhandoff.transport.local import LocalConfig

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("service", "pipelines", "transport")

#: The settings structs of the layers the service assembles (the model and stage sections
#: describe a deployment, not a component's knobs).
SETTINGS: tuple[type[msgspec.Struct], ...] = (
    HandoffConfig,
    PeersConfig,
    RecordsConfig,
    WebhooksConfig,
    MooncakeConfig,
    LocalConfig,
    TransferConfig,
    AuthConfig,
    DecodeSettings,
    PrefillSettings,
)
#: Parameters that are a setting under another name: parameter -> the setting's name.
ALIASES = {
    "max_live": "max_concurrent",
    "verify_default": "verify",
    "max_peers": "max_tracked",
    "interval_s": "heartbeat_interval_s",
    "replay": "sse_buffer",
}


def _setting_defaults() -> dict[str, set[object]]:
    """Each setting's name -> its default values (one name may be in several sections)."""
    out: dict[str, set[object]] = {}
    for struct in SETTINGS:
        for f in msgspec.structs.fields(struct):
            if isinstance(f.default, int | float) and not isinstance(f.default, bool):
                out.setdefault(f.name, set()).add(f.default)
    return out


def _literal_defaults(root: Path) -> list[str]:
    """`path:line function(param=literal)` for each parameter named like a setting whose
    default is a numeric literal equal to that setting's default: written twice."""
    settings = _setting_defaults()
    found = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    continue
                a = node.args
                positional = a.posonlyargs + a.args
                pairs = list(zip(positional[len(positional) - len(a.defaults) :], a.defaults))
                pairs += [(x, d) for x, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None]
                for arg, default in pairs:
                    if not (
                        isinstance(default, ast.Constant) and type(default.value) in (int, float)
                    ):
                        continue
                    if default.value in settings.get(ALIASES.get(arg.arg, arg.arg), set()):
                        where = path.relative_to(root)
                        found.append(f"{where}:{node.lineno} {node.name}({arg.arg}=...)")
    return found


def test_no_constructor_repeats_a_setting_s_default_as_a_literal() -> None:
    assert _literal_defaults(ROOT) == []


def test_the_literal_default_check_can_fail(tmp_path: Path) -> None:
    for package in PACKAGES:
        (tmp_path / package).mkdir()
    (tmp_path / "service" / "x.py").write_text(
        "class A:\n    def __init__(self, default_deadline_s: float = 30.0) -> None: ...\n"
        "def f(*, max_live: int = 256, max_grace_s: float = 1.0) -> None: ...\n"
    )
    found = sorted(_literal_defaults(tmp_path))
    assert found == [
        "service/x.py:2 __init__(default_deadline_s=...)",
        "service/x.py:3 f(max_live=...)",
    ]


def _config() -> Config:
    return load_config(
        None, {}, {"role": "decode", "model": {"preset": "dense-mha"}, "stages": [{"num_pages": 1}]}
    )


def test_the_configuration_s_defaults_are_the_pipelines_defaults() -> None:
    config = _config()
    assert config.handoff.decode_settings() == DECODE_DEFAULTS == DecodeSettings()
    assert config.prefill_settings() == PREFILL_DEFAULTS == PrefillSettings()


@pytest.mark.parametrize(
    ("cls", "defaults"), [(DecodePipeline, DECODE_DEFAULTS), (PrefillPipeline, PREFILL_DEFAULTS)]
)
def test_the_pipelines_default_to_their_settings_struct(cls: type, defaults: object) -> None:
    assert inspect.signature(cls).parameters["settings"].default is defaults


def test_the_heartbeats_take_their_settings_from_the_configuration() -> None:
    handoff = HandoffConfig(heartbeat_interval_s=0.5, peer_timeout_s=2.0)
    peers = PeersConfig(prefill=["http://p:1"], max_tracked=3, watch_retry_min_s=0.25)
    s = HeartbeatSettings.of(handoff, peers)
    assert (s.interval_s, s.timeout_s, s.max_peers, s.watch_retry_min_s, s.configured) == (
        0.5,
        2.0,
        3,
        0.25,
        ("http://p:1",),
    )
    defaults = HeartbeatSettings.of()
    assert (defaults.interval_s, defaults.timeout_s) == (
        HandoffConfig().heartbeat_interval_s,
        HandoffConfig().peer_timeout_s,
    )
    assert "settings" in inspect.signature(Heartbeats).parameters
