"""Bench-only hook for SGLang's own `mooncake` transfer backend on a CPU (`bench/engines.py`).

On the native servers' PYTHONPATH only, never installed. SGLang's prefill hands a sender whose
class says `supports_host_tensor_indices` its page indices in pinned host memory, copied after
a CUDA event, and a CPU torch refuses to pin; with the flag off the prefill converts the
indices as it does for every other backend (`kv_to_page_indices`), and nothing else changes.
The flag is turned off when SGLang imports the module, so processes that never load the
backend pay nothing.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Sequence

TARGET = "sglang.srt.disaggregation.mooncake.conn"


class _Unpin(importlib.abc.MetaPathFinder):
    def find_spec(
        self,
        name: str,
        path: Sequence[str] | None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if name != TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                break
        else:
            return None
        loader = spec.loader
        run = loader.exec_module

        def exec_module(module: types.ModuleType) -> None:
            run(module)
            module.MooncakeKVSender.supports_host_tensor_indices = False

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, _Unpin())
