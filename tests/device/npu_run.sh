#!/usr/bin/env bash
# On an Ascend machine (CANN, torch and torch_npu installed; no network needed): unpack
# .devkit-npu/ (tests/device/npu_kit.sh), name any library Mooncake's NPU engine still lacks,
# then run the NPU checks: tests/device/test_npu.py, the npu:0 case of the packing tests and the
# CPU tests of the NPU path. The two-NPU handoff over protocol ascend runs when
# KVHANDOFF_NPU_HOST names this host's IP and /etc/hccn.conf exists. The log also goes to
# $OUT/npu-check.log when OUT is set.
set -uo pipefail
cd "$(dirname "$0")/../.."
[ -d .devkit-npu ] || {
  echo "no .devkit-npu/: run tests/device/npu_kit.sh first, then bring it along"; exit 3; }
for env in /usr/local/Ascend/ascend-toolkit/set_env.sh /usr/local/Ascend/nnal/atb/set_env.sh; do
  [ -f "$env" ] && . "$env"  # CANN's own libraries and variables, where the image has them
done
. tests/device/unpack.sh
unpack_kit .devkit-npu
npu-smi info || true
python3 -c 'import torch, torch_npu, pytest; print("torch", torch.__version__, "torch_npu",
  torch_npu.__version__, torch.npu.is_available(), torch.npu.device_count(), "pytest",
  pytest.__version__)'
if [ -e "$KIT_SITE/mooncake/engine.so" ]; then
  missing=$(ldd "$KIT_SITE/mooncake/engine.so" "$KIT_SITE/mooncake/ascend_transport.so" \
    | grep 'not found' || true)
  [ -z "$missing" ] || echo "mooncake's NPU engine lacks: $missing"
fi
log=${OUT:-/tmp}/npu-check.log
# Not the repo's pytest settings: they need pytest-asyncio, which these (synchronous) tests do not.
python3 -m pytest -c /dev/null --rootdir "$PWD" -rs -p no:cacheprovider --timeout 300 \
  tests/device/test_npu.py tests/unit/pipelines/test_packing.py tests/unit/transport/test_npu.py \
  tests/unit/transport/test_ascend.py tests/unit/transport/test_pointers.py 2>&1 | tee "$log"
exit "${PIPESTATUS[0]}"
