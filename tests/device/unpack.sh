# Sourced by run.sh and npu_run.sh on a device machine without network: `unpack_kit KIT` puts
# the kit's wheels on PYTHONPATH (a private site) and, of its Debian packages' libraries, those
# whose soname the machine lacks on LD_LIBRARY_PATH (a newer one of the machine's own wins).
# Exits 3 when the wheels cannot be installed.
unpack_kit() {
  local kit=$1 root=/tmp/kvhandoff-devroot site=/tmp/kvhandoff-site have lib
  mkdir -p "$root/use" "$site"
  for deb in "$kit"/deb/*.deb; do [ -e "$deb" ] && dpkg -x "$deb" "$root"; done
  have=$(ldconfig -p | awk '{print $1}')
  for lib in "$root"/usr/lib/*-linux-gnu/*.so.* "$root"/lib/*-linux-gnu/*.so.*; do
    [ -L "$lib" ] || continue
    grep -qxF "$(basename "$lib")" <<<"$have" || ln -sf "$lib" "$root/use/"
  done
  if python3 -m pip --version >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$site" "$kit"/whl/*.whl || exit 3
  else  # an environment made without pip: a wheel is a zip of the files to install
    for whl in "$kit"/whl/*.whl; do python3 -m zipfile -e "$whl" "$site" || exit 3; done
  fi
  export LD_LIBRARY_PATH="$root/use${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export PYTHONPATH="$site:$PWD" PYTHONUNBUFFERED=1
  KIT_SITE=$site
}
