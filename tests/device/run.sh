#!/usr/bin/env bash
# On a machine with a GPU, its Python 3.12 holding CUDA torch and pytest (no network needed):
# unpack .devkit/ (tests/device/kit.sh), name any library Mooncake's engine still lacks, then
# run the device checks: tests/device and the CUDA cases of tests/unit. The log also goes to
# $OUT/device-check.log when OUT is set.
set -uo pipefail
cd "$(dirname "$0")/../.."
[ -d .devkit ] || { echo "no .devkit/: run tests/device/kit.sh first, then bring it along"; exit 3; }
. tests/device/unpack.sh
unpack_kit .devkit
prefix=$(python3 -c 'import sys; print(sys.prefix)')
cudart=$(find "$prefix" /usr/local/cuda* -name 'libcudart.so.13*' 2>/dev/null | head -n 1)
export LD_LIBRARY_PATH="${cudart:+$(dirname "$cudart"):}$LD_LIBRARY_PATH"
nvidia-smi -L || true
python3 -c 'import torch, pytest; print("torch", torch.__version__, "cuda", torch.version.cuda,
  torch.cuda.is_available(), "pytest", pytest.__version__)'
missing=$(ldd "$KIT_SITE/mooncake/engine.so" | grep 'not found' || true)
[ -z "$missing" ] || echo "mooncake's engine lacks: $missing"
log=${OUT:-/tmp}/device-check.log
# Not the repo's pytest settings: they need pytest-asyncio, which these (synchronous) tests do not.
python3 -m pytest -c /dev/null --rootdir "$PWD" -rs -p no:cacheprovider --timeout 300 \
  tests/device tests/unit/transport/test_pointers.py tests/unit/pipelines/test_packing.py \
  2>&1 | tee "$log"
exit "${PIPESTATUS[0]}"
