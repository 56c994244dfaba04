#!/usr/bin/env bash
# Builds .devkit-npu/ here: what an Ascend machine without network lacks to run the NPU checks
# (tests/device/npu_run.sh there). Its image is expected to hold CANN, torch and the matching
# torch_npu (they are the machine's, never brought). Wheels for its Python (PY, default 3.11)
# and architecture (ARCH, default x86_64): Mooncake's NPU build (published for cp311 x86_64
# only: on aarch64 the kit brings none and the handoff check skips), and what kvhandoff and the
# checks import beyond torch and numpy; the RDMA/NUMA libraries the engine links, as Debian
# packages of this machine's architecture, unpacked there only where missing. Needs the
# package lists.
set -euo pipefail
cd "$(dirname "$0")/../.."
kit=.devkit-npu
PY=${PY:-3.11}
ARCH=${ARCH:-x86_64}
MOONCAKE_NPU=${MOONCAKE_NPU:-mooncake-transfer-engine-npu==0.3.13.post1}
rm -rf "$kit"
mkdir -p "$kit/whl" "$kit/deb"
platforms=()
for tag in manylinux_2_35 manylinux_2_28 manylinux_2_17 manylinux2014; do
  platforms+=(--platform "${tag}_${ARCH}")
done
fetch() {
  python3 -m pip download -q --only-binary=:all: --python-version "$PY" --implementation cp \
    "${platforms[@]}" -d "$kit/whl" "$@"
}
[ "$ARCH" != x86_64 ] || fetch --no-deps "$MOONCAKE_NPU"
fetch msgspec xxhash "aiohttp>=3.9,<4" uvloop prometheus-client pytest pytest-timeout pytest-asyncio \
  msgpack requests
if [ "$(dpkg --print-architecture)" = "$([ "$ARCH" = x86_64 ] && echo amd64 || echo arm64)" ]; then
  (cd "$kit/deb" && apt-get -q download libibverbs1 librdmacm1 ibverbs-providers libnuma1 \
    libnl-3-200 libnl-route-3-200)
else
  echo "no Debian packages: this machine is not $ARCH (the Ascend machine must have them)"
fi
du -sh "$kit"
