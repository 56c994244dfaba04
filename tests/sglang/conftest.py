"""The SGLang environment for these tests: the torchvision stub first on sys.path (and on the
PYTHONPATH of the processes the tests start), then SGLang itself, imported here so a missing
SGLang is a collection error in CI, never a skip."""

from __future__ import annotations

import os
import sys
from pathlib import Path

STUBS = Path(__file__).resolve().parent / "stubs"
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(STUBS))
# The tests' model is a config.json in a temporary folder: never look it up online.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(STUBS), str(ROOT), os.environ.get("PYTHONPATH", "")) if p
)

import sglang  # noqa: E402,F401  -- fails the run (not skips it) outside `make sglang-env`
