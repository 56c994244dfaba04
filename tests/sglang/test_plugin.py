"""The plugin through SGLang's own loader: entry point, CLI choice, enum member, class lookup."""

from __future__ import annotations

import importlib.metadata

from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES
from sglang.srt.disaggregation.common.conn import CommonKVBootstrapServer
from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class
from sglang.srt.plugins import load_plugins


def test_the_entry_point_is_installed_in_sglang_s_group() -> None:
    eps = importlib.metadata.entry_points(group="sglang.srt.plugins")
    ours = [ep for ep in eps if ep.name == "kvhandoff"]
    assert [ep.value for ep in ours] == ["kvhandoff.service.integrations.sglang.plugin:register"]


def test_load_plugins_makes_kvhandoff_a_backend_and_leaves_mooncake_alone() -> None:
    load_plugins()
    from sglang.srt.disaggregation import utils
    from sglang.srt.disaggregation.mooncake import MooncakeKVManager

    from kvhandoff.service.integrations.sglang.bootstrap import KVHandoffBootstrapServer
    from kvhandoff.service.integrations.sglang.manager import KVHandoffManager
    from kvhandoff.service.integrations.sglang.receiver import KVHandoffReceiver
    from kvhandoff.service.integrations.sglang.sender import KVHandoffSender

    assert "kvhandoff" in DISAGG_TRANSFER_BACKEND_CHOICES
    backend = TransferBackend("kvhandoff")
    assert backend is TransferBackend.KVHANDOFF and backend in list(TransferBackend)
    lookup = utils.get_kv_class  # the patched module attribute, as SGLang's callers see it
    assert lookup(backend, KVClassType.MANAGER) is KVHandoffManager
    assert lookup(backend, KVClassType.SENDER) is KVHandoffSender
    assert lookup(backend, KVClassType.RECEIVER) is KVHandoffReceiver
    assert lookup(backend, KVClassType.BOOTSTRAP_SERVER) is KVHandoffBootstrapServer
    assert lookup(TransferBackend.MOONCAKE, KVClassType.MANAGER) is MooncakeKVManager
    # A `from utils import get_kv_class` binding taken before the patch (this module's) sees it.
    assert get_kv_class(backend, KVClassType.MANAGER) is KVHandoffManager


def test_server_args_accept_the_backend() -> None:
    load_plugins()
    from sglang.srt.server_args import ServerArgs

    for mode in ("prefill", "decode"):
        args = ServerArgs(
            model_path="unused",
            disaggregation_mode=mode,
            disaggregation_transfer_backend="kvhandoff",
        )
        assert args.disaggregation_transfer_backend == "kvhandoff"


def test_the_rust_server_does_not_stand_in_for_our_bootstrap_server() -> None:
    # SGLang's Rust server replaces any CommonKVBootstrapServer subclass with its own,
    # unauthenticated, registry; ours must keep serving.
    load_plugins()
    from sglang.srt.managers.disagg_service import rust_server_serves_kv_bootstrap

    server_class = get_kv_class(TransferBackend.KVHANDOFF, KVClassType.BOOTSTRAP_SERVER)
    assert not issubclass(server_class, CommonKVBootstrapServer)
    assert rust_server_serves_kv_bootstrap("kvhandoff") is False
    assert rust_server_serves_kv_bootstrap("mooncake") is True
