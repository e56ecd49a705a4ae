#!/usr/bin/env bash
# Installs everything the test suite needs on a fresh Debian machine, then runs it.
#
# System packages: Debian's chromium at /usr/bin/chromium (the browser tests drive
# that exact binary; a chromium elsewhere on PATH does not count), Debian's
# redis-server (the fleet tests start their own on loopback) and coturn (the TURN tests too). Python: the
# torch engine's CPU build (torch 2.13.0+cpu: from PyTorch's CPU index on a plain
# machine, or from a local wheel where pip is configured with one) and the
# project with its test, gpu, scale (Ray Serve, the Redis client), pipecat and livekit extras.
# Nothing is downloaded at test time.
set -euo pipefail
cd "$(dirname "$0")/.."

as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

# espeak-ng speaks the callers of the barge-in tests; libspeexdsp1 is the echo canceller (gateway/caller/speex.py);
# coturn is the TURN server the relay-only browser tests connect through (tests/web/test_turn_server.py).
if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/redis-server ] || [ ! -x /usr/bin/espeak-ng ] \
    || [ ! -x /usr/bin/turnserver ] || [ ! -x /usr/bin/openssl ] || ! ldconfig -p | grep -q libspeexdsp.so.1; then
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium redis-server \
    espeak-ng libspeexdsp1 coturn openssl
fi

pip_install() { python3 -m pip install -q --disable-pip-version-check --retries 2 "$@"; }
# On PyPI, plain "torch==2.13.0" is the multi-GB CUDA build; "+cpu" is only on PyTorch's CPU index.
pip_install "torch==2.13.0+cpu" --extra-index-url https://download.pytorch.org/whl/cpu
# pipecat and livekit: the plugins (voxgate.integrations) are tested in their frameworks. Together with
# scale they resolve to protobuf 6.33 (pipecat-ai 1.14 needs <7) and grpcio-reflection 1.81 (its 1.85 needs
# protobuf 7); Ray Serve's gRPC ingress, onnx and onnxruntime pass their tests on that (tests/pool, tests/engine).
pip_install -e ".[test,gpu,scale,pipecat,livekit,whisper]"

# ruff, mypy and the import contracts: seconds, before minutes of tests.
bash scripts/lint.sh

# Two parts, both required to pass. First the tests side by side in pytest-xdist worker processes
# (VOXGATE_TEST_WORKERS, default 4: most tests wait on real-time audio, not on a core; on this 2-core machine
# 4 workers took 188 s, 3 took 260 s and 5 took 212 s with a loop-lag refusal), each
# module or shared-server folder on one worker; then, alone, the tests whose asserts depend on how
# fast the machine serves them (marked `timing` from tests/timing.py), which side by side would
# measure their neighbours. Extra arguments go to both parts; a part they select nothing from passes.
workers="${VOXGATE_TEST_WORKERS:-4}"
pytest_part() { python3 -m pytest -q -ra -p no:cacheprovider --durations=25 "$@"; }
passed() { [ "$1" -eq 0 ] || { [ "$1" -eq 5 ] && [ "$2" -gt 0 ]; }; }
status=0
pytest_part -n "$workers" --dist loadgroup -m "not timing" "$@" || status=$?
passed "$status" "$#" || echo "test.sh: the parallel part failed (pytest exit $status)" >&2
serial=0
# Without arguments the serial part collects only the modules that hold timing tests (seconds, not a minute).
if [ "$#" -eq 0 ]; then read -r -a serial_args <<<"$(python3 -m tests.timing)"; else serial_args=("$@"); fi
pytest_part -m timing "${serial_args[@]}" || serial=$?
passed "$serial" "$#" || echo "test.sh: the serial part failed (pytest exit $serial)" >&2
passed "$status" "$#" && passed "$serial" "$#"
