#!/usr/bin/env bash
# `make image`: build the CPU service image from docker/Dockerfile on this machine.
#
#   docker/build-image.sh PYTHON IMAGE
#
# PYTHON is the project's venv python (its pip, with this host's pip configuration, builds the
# wheelhouse); IMAGE the tag to build. Environment: BASE (default python:3.11-slim-bookworm),
# TORCH_CPU (the pinned CPU torch requirement), KVHANDOFF_IMAGE_CACHE (default
# ~/.cache/kvhandoff-image), DEBIAN_MIRROR (default: the bookworm mirror of this machine's apt
# sources).
#
# What is cached between runs on one machine, keyed by its inputs:
#   - the base image: BASE if present or pullable, else localhost/kvhandoff-base:bookworm made
#     by mmdebstrap (its tarball is kept in the cache, keyed by the package list);
#   - the dependency wheelhouse, keyed by pyproject.toml, TORCH_CPU and the host's Python;
#   - the image layers (podman's layer cache: the dependency layer is reused until the
#     wheelhouse changes; only the kvhandoff wheel layer follows source changes).
set -euo pipefail
shopt -s inherit_errexit  # a failure inside $(...) stops the build too

BASE=${BASE:-python:3.11-slim-bookworm}
TORCH_CPU=${TORCH_CPU:-torch==2.13.0}
CACHE=${KVHANDOFF_IMAGE_CACHE:-${XDG_CACHE_HOME:-${HOME:?set HOME or KVHANDOFF_IMAGE_CACHE}/.cache}/kvhandoff-image}
LOCAL_BASE=localhost/kvhandoff-base:bookworm
# python3 + venv is what python:3.11-slim-bookworm offers; the four libraries are Mooncake's
# (with them in the base, the Dockerfile's apt step needs no package index).
BASE_PACKAGES=python3,python3-venv,ca-certificates,libibverbs1,librdmacm1,libnuma1,libcurl4
WHEELHOUSE=build/wheelhouse
APT_ETC=${APT_ETC:-/etc/apt}  # where debian_mirror reads the apt sources (tests point elsewhere)

say() { printf '[image] %s\n' "$*" >&2; }

# The bookworm mirror this machine's apt uses (deb822 .sources files or one-line lists).
debian_mirror() {
    if [[ -n ${DEBIAN_MIRROR:-} ]]; then echo "$DEBIAN_MIRROR"; return; fi
    local f
    for f in "$APT_ETC"/sources.list.d/*.sources; do
        [[ -r $f ]] || continue
        awk 'BEGIN { RS = ""; FS = "\n" }
             {
               uris = ""; suite = 0; deb = 0
               for (i = 1; i <= NF; i++) {
                 if ($i ~ /^Types:/ && $i ~ /[[:space:]]deb([[:space:]]|$)/) deb = 1
                 if ($i ~ /^URIs:/) { uris = $i; sub(/^URIs:[[:space:]]*/, "", uris) }
                 if ($i ~ /^Suites:/ && $i ~ /[[:space:]]bookworm([[:space:]]|$)/) suite = 1
               }
               if (deb && suite && uris != "") { split(uris, u, /[[:space:]]+/); print u[1]; exit }
             }' "$f"
    done | head -n1 | grep . && return
    for f in "$APT_ETC"/sources.list "$APT_ETC"/sources.list.d/*.list; do
        [[ -r $f ]] || continue
        # deb [option=value ...] URI SUITE COMPONENT...
        awk '$1 == "deb" {
               i = 2
               if ($i ~ /^\[/) { while (i < NF && $i !~ /\]$/) i++; i++ }
               if ($(i + 1) == "bookworm") { print $i; exit }
             }' "$f"
    done | head -n1 | grep . && return
    echo "no Debian bookworm source in $APT_ETC; set DEBIAN_MIRROR" >&2
    return 1
}

resolve_base() {
    if podman image exists "$BASE"; then echo "$BASE"; return; fi
    if timeout 120 podman pull -q "$BASE" >/dev/null 2>&1; then echo "$BASE"; return; fi
    say "$BASE cannot be pulled here; using $LOCAL_BASE (Debian bookworm from mmdebstrap)"
    if ! podman image exists "$LOCAL_BASE"; then
        local key tarball mirror
        key=$(printf '%s' "$BASE_PACKAGES" | sha256sum | cut -c1-16)
        tarball=$CACHE/base-bookworm-$key.tar
        if [[ ! -s $tarball ]]; then
            mirror=$(debian_mirror)
            say "mmdebstrap bookworm from $mirror"
            mmdebstrap --quiet --format=tar --variant=minbase --include="$BASE_PACKAGES" \
                --dpkgopt='path-exclude=/usr/share/man/*' \
                --dpkgopt='path-exclude=/usr/share/locale/*' \
                --dpkgopt='path-exclude=/usr/share/doc/*' \
                --dpkgopt='path-include=/usr/share/doc/*/copyright' \
                bookworm "${tarball%.tar}.partial.tar" "$mirror"
            mv "${tarball%.tar}.partial.tar" "$tarball"
        fi
        podman import -q "$tarball" "$LOCAL_BASE" >/dev/null
    fi
    echo "$LOCAL_BASE"
}

# Every dependency as a wheel, built once per (pyproject.toml, torch pin, host Python).
deps_wheelhouse() {
    local version key dir
    version=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    if [[ $version != 3.11 ]]; then
        echo "the image runs Python 3.11; $PY is $version, so its wheels would not fit" >&2
        return 1
    fi
    key=$( { cat pyproject.toml; echo "$TORCH_CPU"; "$PY" -VV; uname -m; } | sha256sum | cut -c1-16)
    dir=$CACHE/wheels-$key
    if [[ ! -d $dir ]]; then
        say "building the dependency wheelhouse ($TORCH_CPU + .[cpu])"
        rm -rf "$dir.tmp"
        "$PY" -m pip wheel -q --wheel-dir "$dir.tmp" "$TORCH_CPU" ".[cpu]"
        rm -f "$dir.tmp"/kvhandoff-*.whl
        mv "$dir.tmp" "$dir"
    fi
    rm -rf "$WHEELHOUSE/deps"
    mkdir -p "$WHEELHOUSE"
    cp -al "$dir" "$WHEELHOUSE/deps" 2>/dev/null || cp -a "$dir" "$WHEELHOUSE/deps"
}

project_wheel() {
    rm -rf "$WHEELHOUSE/project"
    # A fixed timestamp makes the wheel a function of the sources, so podman reuses the layer
    # when they did not change.
    SOURCE_DATE_EPOCH=315532800 "$PY" -m pip wheel -q --no-deps --wheel-dir "$WHEELHOUSE/project" .
}

main() {
    PY=${1:?usage: build-image.sh PYTHON IMAGE}
    IMAGE=${2:?usage: build-image.sh PYTHON IMAGE}
    cd "$(dirname "$0")/.."
    mkdir -p "$CACHE"
    local base previous
    base=$(resolve_base)
    deps_wheelhouse
    project_wheel
    previous=$(podman image inspect --format '{{.Id}}' "$IMAGE" 2>/dev/null || true)
    say "podman build $IMAGE from $base"
    podman build --isolation chroot --format docker --layers --pull=missing \
        --build-arg "BASE=$base" -f docker/Dockerfile -t "$IMAGE" .
    # The image this build replaced is untagged now: drop it (kept if it is still in use).
    if [[ -n $previous && $previous != $(podman image inspect --format '{{.Id}}' "$IMAGE") ]]; then
        podman rmi "$previous" >/dev/null 2>&1 || true
    fi
    size=$(podman image inspect --format '{{.Size}}' "$IMAGE")
    say "$IMAGE: $((size / 1000000)) MB"
}

# Sourced (tests/unit/test_docker.py), it only defines the functions.
if [[ ${BASH_SOURCE[0]} == "$0" ]]; then
    main "$@"
fi
