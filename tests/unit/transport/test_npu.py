"""NPU memory through torch_npu (`kvhandoff.transport.npu`), dispatched by device type, without an
NPU.

torch_npu cannot be installed here. Where a test needs its import to succeed it says so and
uses `tests.fakes.StandInTorchNpu`, which only records what kvhandoff asked torch_npu for: no
test here claims that a byte moved on an NPU (`tests/device/test_npu.py` does, on Ascend).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvhandoff.transport.errors import PoolError
from kvhandoff.transport.npu import ACL_FORMAT_ND, npu_tensor_at, use_npu
from kvhandoff.transport.pointers import tensor_at
from kvhandoff.transport.pool_torch import TorchPool, npu_device
from kvhandoff.transport.pools import open_pool
from tests.fakes import NpuDevice, StandInTorchNpu, TorchWithNpu


@pytest.fixture
def no_torch_npu(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch_npu not installed, whatever this machine has (None in sys.modules fails its import)."""
    monkeypatch.setitem(sys.modules, "torch_npu", None)


def stand_in(monkeypatch: pytest.MonkeyPatch, **kwargs: object) -> StandInTorchNpu:
    """An importable torch_npu (the tests that need the import to succeed)."""
    module = StandInTorchNpu(**kwargs)  # type: ignore[arg-type]
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    return module


@pytest.mark.usefixtures("no_torch_npu")
@pytest.mark.parametrize(
    ("make", "named"),
    [
        (lambda: TorchPool([4096], "npu:0", align_bytes=4096), "pool device 'npu:0' needs"),
        (lambda: open_pool("torch:npu", [4096]), "pool device 'npu' needs"),
        (lambda: tensor_at(1 << 21, 4096, "npu:3"), "buffers on 'npu:3' needs"),
    ],
)
def test_without_torch_npu_npu_memory_is_refused_naming_it(make: object, named: str) -> None:
    with pytest.raises(PoolError) as err:
        make()  # type: ignore[operator]
    assert named in err.value.message
    assert "torch_npu, which is not installed (install kvhandoff[ascend]" in err.value.message


def test_a_torch_npu_that_fails_to_load_is_named(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    package = tmp_path / "torch_npu"
    package.mkdir()
    # What an installed torch_npu raises without its CANN toolkit (a real import, failing).
    (package / "__init__.py").write_text(
        'raise OSError("libhccl.so: cannot open shared object file: No such file or directory")\n'
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    with pytest.raises(PoolError) as err:
        TorchPool([4096], "npu:0", align_bytes=4096)
    assert err.value.message == (
        "pool device 'npu:0' needs torch_npu, which failed to load: libhccl.so: cannot open "
        "shared object file: No such file or directory"
    )
    assert err.value.context["field"] == "pool"


@pytest.mark.parametrize(
    ("devices", "device", "named"),
    [
        (0, "npu:0", "'npu:0' is not visible: this process sees 0 npu device(s) (check ASCEND"),
        (2, "npu:2", "'npu:2' is not visible: this process sees 2 npu device(s)"),
        (2, "npu:x", "invalid torch device 'npu:x'"),
    ],
)
def test_an_npu_this_process_cannot_use_is_named(
    monkeypatch: pytest.MonkeyPatch, devices: int, device: str, named: str
) -> None:
    stand_in(monkeypatch, devices=devices)  # imports; reports `devices` NPUs
    with pytest.raises(PoolError) as err:
        npu_device(TorchWithNpu, device)
    assert named in err.value.message


def test_npu_memory_is_wrapped_by_address_in_the_plain_format_without_a_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch_npu = stand_in(monkeypatch, devices=4)  # imports; records the constructor calls
    tensor = npu_tensor_at(TorchWithNpu, 0x7F00_0020_0000, 3 << 20, NpuDevice("npu", 2))
    here = NpuDevice("npu", 2)
    assert tensor.data_ptr() == 0x7F00_0020_0000 and tensor.device == here
    (storage_call, tensor_call) = torch_npu.calls
    # A storage over the address on that NPU, of exactly that length (never freed by torch).
    assert storage_call == ("storage", (0x7F00_0020_0000, here, 3 << 20))
    metadata, storage = tensor_call[1]
    assert metadata == {
        "dtype": TorchWithNpu.uint8,
        "size": [3 << 20],
        "stride": [1],
        "storage_offset": 0,
        "npu_format": ACL_FORMAT_ND,
    }
    assert storage == (0x7F00_0020_0000, here)
    # "npu" alone is the first NPU: the wrap is compared with where it lands.
    first = npu_tensor_at(TorchWithNpu, 1 << 21, 64, NpuDevice("npu", None))
    assert first.device == NpuDevice("npu", 0)


def test_a_torch_npu_without_the_pointer_constructors_is_refused_naming_its_version(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stand_in(monkeypatch, constructors=False)  # imports, lacks the private constructors
    with pytest.raises(PoolError) as err:
        npu_tensor_at(TorchWithNpu, 1 << 21, 64, NpuDevice("npu", 0))
    assert "torch_npu 2.6.0.stand-in cannot wrap NPU memory it did not allocate" in str(err.value)
    assert "_construct_storage_from_data_pointer" in str(err.value)


def test_a_wrap_that_does_not_alias_the_address_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stand_in(monkeypatch, aliases=False)  # imports; its tensor lands 4 KiB off
    with pytest.raises(PoolError) as err:
        npu_tensor_at(TorchWithNpu, 1 << 21, 64, NpuDevice("npu", 0))
    assert "buffer at 0x200000 is not memory of npu:0" in err.value.message
    assert "at 0x201000" in err.value.message


def test_the_engine_s_npu_is_made_current_through_torch_npu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch_npu = stand_in(monkeypatch, devices=4)  # imports; records set_device
    use_npu(2)
    assert torch_npu.calls == [("set_device", (2,))]
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    with pytest.raises(PoolError) as err:
        use_npu(2)
    assert err.value.context["field"] == "transport.npu"
