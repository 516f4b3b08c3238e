#!/usr/bin/env bash
# Idempotent set-up: a virtual environment in .venv with pinned torch, Horovod built from
# source (PyTorch + Gloo, NCCL where CUDA is present), and this package in editable mode.
# The built Horovod wheel is cached in $LS_WHEEL_CACHE (default ~/.cache/lightning-straggler/wheels)
# so a second run, or a second clone on the same machine, does not rebuild it (~7 min on 2 cores).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${LS_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
TORCH_VERSION="${LS_TORCH_VERSION:-2.13.0}"
HOROVOD_VERSION="0.28.1"
WHEEL_CACHE="${LS_WHEEL_CACHE:-$HOME/.cache/lightning-straggler/wheels}"

log() { echo "[setup] $*"; }

if [ ! -x "$VENV/bin/python" ]; then
  log "creating virtual environment $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
PIP=("$PY" -m pip --disable-pip-version-check -q)

have() { "$PY" - "$1" <<'PY' 2>/dev/null
import importlib.metadata as m, sys
name, _, version = sys.argv[1].partition("==")
try:
    v = m.version(name)
except m.PackageNotFoundError:
    sys.exit(1)
sys.exit(0 if not version or v.split("+")[0] == version else 1)
PY
}

# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build.
if ! have "torch==$TORCH_VERSION"; then
  log "installing torch==$TORCH_VERSION"
  "${PIP[@]}" install "torch==$TORCH_VERSION"
fi

# Horovod is built with this project's patches (scripts/patches/horovod-$HOROVOD_VERSION-*.patch, each
# says what it fixes); the wheel's local version label (+lsNNNNNNNN, a hash of the patches) tells the
# build apart from a stock one, here and at run time (lightning_straggler.comm.horovod.join_is_fixed).
PATCHES=("$ROOT"/scripts/patches/horovod-"$HOROVOD_VERSION"-*.patch)
[ -e "${PATCHES[0]}" ] || PATCHES=()
LOCAL_VERSION=""
if [ ${#PATCHES[@]} -gt 0 ]; then
  LOCAL_VERSION="ls$(cat "${PATCHES[@]}" | sha1sum | cut -c1-8)"
fi
WANT_HOROVOD="$HOROVOD_VERSION${LOCAL_VERSION:++$LOCAL_VERSION}"
installed_horovod() { "$PY" -c 'import importlib.metadata as m; print(m.version("horovod"))' 2>/dev/null || true; }

if [ "$(installed_horovod)" != "$WANT_HOROVOD" ]; then
  mkdir -p "$WHEEL_CACHE"
  TAG="torch${TORCH_VERSION}-$("$PY" -c 'import sys;print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')"
  if command -v nvcc >/dev/null 2>&1 && "$PY" -c 'import torch,sys; sys.exit(0 if torch.version.cuda else 1)'; then
    TAG="$TAG-nccl"
  fi
  CACHED_DIR="$WHEEL_CACHE/$TAG"
  WHEEL_GLOB="horovod-$WANT_HOROVOD-*.whl"
  if ! ls "$CACHED_DIR"/$WHEEL_GLOB >/dev/null 2>&1; then
    log "building Horovod $WANT_HOROVOD from source (about 7 minutes on 2 cores); wheel cached in $CACHED_DIR"
    "${PIP[@]}" install numpy "cmake<5" wheel setuptools packaging
    BUILD_DIR="$(mktemp -d)"
    trap 'rm -rf "$BUILD_DIR"' EXIT
    "${PIP[@]}" download --no-deps --no-binary :all: -d "$BUILD_DIR/sdist" "horovod==$HOROVOD_VERSION"
    tar -xzf "$BUILD_DIR"/sdist/horovod-"$HOROVOD_VERSION".tar.gz -C "$BUILD_DIR"
    SRC="$BUILD_DIR/horovod-$HOROVOD_VERSION"
    for p in "${PATCHES[@]}"; do
      log "applying $(basename "$p")"
      if command -v patch >/dev/null 2>&1; then patch -s -p1 -d "$SRC" < "$p"; else (cd "$SRC" && git apply -p1 "$p"); fi
    done
    if [ -n "$LOCAL_VERSION" ]; then export HOROVOD_LOCAL_VERSION="$LOCAL_VERSION"; fi
    # Horovod hard-codes -std=c++14 for its torch extension; torch >= 2.1 needs C++17.
    # A compiler wrapper that appends -std=c++17 last wins over the earlier flag.
    cat > "$BUILD_DIR/cxx17" <<'SH'
#!/usr/bin/env bash
exec "${LS_REAL_CXX:-g++}" "$@" -std=c++17
SH
    chmod +x "$BUILD_DIR/cxx17"
    export LS_REAL_CXX="${CXX:-g++}"
    export CXX="$BUILD_DIR/cxx17"
    export CMAKE_POLICY_VERSION_MINIMUM=3.5   # CMake 4 refuses the bundled gloo's old minimum
    export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1
    export HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_CPU_OPERATIONS=GLOO
    if [[ "$TAG" == *-nccl ]]; then export HOROVOD_GPU_OPERATIONS=NCCL; fi
    export MAKEFLAGS="-j$(nproc)"
    PATH="$VENV/bin:$PATH" "${PIP[@]}" wheel --no-build-isolation --no-deps -w "$BUILD_DIR/out" "$SRC"
    mkdir -p "$CACHED_DIR"
    cp "$BUILD_DIR"/out/horovod-*.whl "$CACHED_DIR/"
  else
    log "using cached Horovod wheel from $CACHED_DIR"
  fi
  "${PIP[@]}" install --no-deps --force-reinstall "$CACHED_DIR"/$WHEEL_GLOB
  # Horovod's own runtime dependencies (its wheel was installed with --no-deps).
  "${PIP[@]}" install cloudpickle psutil pyyaml packaging cffi
fi

# The package and its test extras, and the slurm extra (hydra-submitit-launcher, small) so that
# hydra/launcher=submitit_slurm and the SLURM test work (torch already satisfied, nothing big is pulled).
if [ ! -f "$VENV/.ls-installed" ] || [ "$ROOT/pyproject.toml" -nt "$VENV/.ls-installed" ]; then
  log "installing lightning_straggler and its dependencies"
  "${PIP[@]}" install "torch==$TORCH_VERSION" -e "$ROOT[test,slurm]"
  touch "$VENV/.ls-installed"
fi
"$PY" -c 'import horovod.torch as hvd; assert hvd.gloo_built(), "Horovod was built without Gloo"' \
  || { echo "[setup] Horovod import failed; remove $WHEEL_CACHE and rerun" >&2; exit 1; }
log "ready: $VENV"
