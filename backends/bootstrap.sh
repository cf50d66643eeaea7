#!/usr/bin/env bash
# Run a project command on an offline GPU host from a bundle made by `triton-pd bundle DIR`.
#
#   bash DIR/bootstrap.sh COMMAND [ARGS...]      (from the project root)
#   e.g. bash .bundle/bootstrap.sh python3 -m pytest -q -m gpu tests/kernels
#        bash .bundle/bootstrap.sh python3 -m backends.cli serve --model random:llama3.1-8b
#
# First use unpacks tritonserver and makes an overlay virtualenv in $TRITON_PD_HOME (default
# /tmp/triton-pd-bundle): the bundle's numpy 1.26.4 (the Python backend needs numpy < 2), tritonclient,
# python-rapidjson and protobuf 4 shadow the host's packages; everything else (torch, triton, transformers, ...)
# comes from the host's python3 through a .pth file. Later uses reuse it. Then COMMAND runs with the overlay's
# python3 first on PATH, which is also the python3 Triton's stub takes its packages from. The host's SciPy is
# hidden there (a None entry in sys.modules, which find_spec reports as absent): built for numpy >= 2, it fails
# under numpy 1.26, and transformers imports it whenever it is installed (its image processors did, in master
# and prefill, with "module 'numpy' has no attribute 'long'").
set -euo pipefail
BUNDLE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
HOME_DIR="${TRITON_PD_HOME:-/tmp/triton-pd-bundle}"
ROOT="$(pwd)"
if [ $# -eq 0 ]; then
  sed -n "2,15p" "${BASH_SOURCE[0]}"
  exit 2
fi
HOST_PY="$(command -v python3)"
VER="$("$HOST_PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
if [ ! -x "$HOME_DIR/site/pytriton/tritonserver/bin/tritonserver" ]; then
  echo "bootstrap: unpacking tritonserver into $HOME_DIR/site" >&2
  mkdir -p "$HOME_DIR/site"
  tar -xJf "$BUNDLE/tritonserver.tar.xz" -C "$HOME_DIR/site"
fi
VENV="$HOME_DIR/venv"
SITE="$VENV/lib/python$VER/site-packages"
if [ ! -f "$SITE/triton_pd_overlay.pth" ]; then
  echo "bootstrap: overlay virtualenv $VENV over $HOST_PY (Python $VER)" >&2
  HOST_SITE="$("$HOST_PY" -c 'import site; print("\n".join(site.getsitepackages()))')"
  rm -rf "$VENV"
  "$HOST_PY" -m venv --without-pip "$VENV"
  mkdir -p "$SITE"
  tar -xJf "$BUNDLE/overlay.tar.xz" -C "$SITE"
  { echo "$HOME_DIR/site"; echo "$HOST_SITE"; } > "$SITE/triton_pd_overlay.pth"
fi
echo 'import sys; sys.modules.setdefault("scipy", None)' > "$SITE/triton_pd_hide.pth"
echo "$ROOT" > "$SITE/triton_pd_project.pth"
export PATH="$VENV/bin:$PATH"
exec "$@"
