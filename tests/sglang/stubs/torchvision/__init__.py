"""Test-only stand-in for torchvision, on sys.path of the SGLang-environment tests only.

SGLang's config and multimodal modules import torchvision at module level (`import
torchvision.transforms as T`, `InterpolationMode.BICUBIC` as defaults), so importing
`sglang.srt.disaggregation.*` needs it; the PyPI wheel is built against a CUDA torch and fails to
load against the CPU torch 2.13 these tests use. Nothing on the transfer path calls it: every
attribute is a placeholder class that raises if instantiated, and `torchvision.<anything>` imports
as an empty module of placeholders. Never installed, never on a production path.
"""

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+stub"


class _Meta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(f"{cls.__qualname__}.{name}")

    def __call__(cls, *a, **k):
        raise RuntimeError(f"torchvision stub: {cls.__qualname__} is not available on CPU tests")


def _placeholder(name):
    return _Meta(name, (), {"__qualname__": name})


class _Module(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(f"{self.__name__}.{name}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Module(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Finder())
