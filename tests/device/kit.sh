#!/usr/bin/env bash
# Builds .devkit/ here: what a GPU machine without network lacks to run the device checks
# (tests/device/run.sh there). Mooncake's CUDA 13 build with the array calls (0.3.14) and msgspec
# as wheels for its Python 3.12, and the RDMA/NUMA libraries the engine links as Debian packages
# (Debian 12's: glibc 2.34 or newer), unpacked there without installing; run.sh uses one only
# where the machine lacks it. Not carried: libcurl.so.4, which the engine links too and any
# image with curl has (run.sh names it if missing). About 50 MB; needs the package lists.
set -euo pipefail
cd "$(dirname "$0")/../.."
kit=.devkit
rm -rf "$kit"
mkdir -p "$kit/whl" "$kit/deb"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$kit/whl" \
  mooncake-transfer-engine-cuda13==0.3.14 msgspec
(cd "$kit/deb" && apt-get -q download libibverbs1 librdmacm1 ibverbs-providers libnuma1 \
  libnl-3-200 libnl-route-3-200)
du -sh "$kit"
