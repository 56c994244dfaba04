#!/usr/bin/env bash
# On a machine with a GPU, its Python 3.12 holding CUDA torch and pytest (no network needed):
# unpack .devkit/ (tests/device/kit.sh), name any library Mooncake's engine still lacks, then
# run the device checks: tests/device and the CUDA cases of tests/unit. The log also goes to
# $OUT/device-check.log when OUT is set.
set -uo pipefail
cd "$(dirname "$0")/../.."
[ -d .devkit ] || { echo "no .devkit/: run tests/device/kit.sh first, then bring it along"; exit 3; }
root=/tmp/kvhandoff-devroot
site=/tmp/kvhandoff-site
mkdir -p "$root" "$site"
for deb in .devkit/deb/*.deb; do dpkg -x "$deb" "$root"; done
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target "$site" .devkit/whl/*.whl || exit 3
prefix=$(python3 -c 'import sys; print(sys.prefix)')
cudart=$(find "$prefix" /usr/local/cuda* -name 'libcudart.so.13*' 2>/dev/null | head -n 1)
libs="$root/usr/lib/x86_64-linux-gnu:$root/lib/x86_64-linux-gnu"
export LD_LIBRARY_PATH="$libs${cudart:+:$(dirname "$cudart")}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PYTHONPATH="$site:$PWD" PYTHONUNBUFFERED=1
nvidia-smi -L || true
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.is_available())'
missing=$(ldd "$site/mooncake/engine.so" | grep 'not found' || true)
[ -z "$missing" ] || echo "mooncake's engine lacks: $missing"
log=${OUT:-/tmp}/device-check.log
python3 -m pytest -rs -p no:cacheprovider tests/device tests/unit/transport/test_pointers.py \
  tests/unit/pipelines/test_packing.py 2>&1 | tee "$log"
exit "${PIPESTATUS[0]}"
