#!/bin/bash
# Everything the GPU machine runs in one call (from the repo root, as root):
#   source .gpubundle/activate.sh && bash tests/gpu/run.sh
# sits_trace is made importable through a folder of symlinks (nothing is installed).
set -uo pipefail
OUT=${OUT:-/tmp/sits-gpu}
PY=${PY:-/opt/torch/.venv/bin/python3}
mkdir -p "$OUT"
pkg=$(mktemp -d)/sitspkg
mkdir -p "$pkg/sits_trace"
for d in agent bpf exporters analyzers; do ln -s "$PWD/$d" "$pkg/sits_trace/$d"; done
export PYTHONPATH="$pkg${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader
uname -r
set -o pipefail
# test_cuda_probes.py's program finds its stand-in libcuda.so.1 through DT_RUNPATH (Ubuntu's ld
# writes RUNPATH for -rpath), which LD_LIBRARY_PATH overrides: with the driver's folder there
# (/usr/local/nvidia/lib64 on the H200 image) it called the real driver with made-up handles
# and died with SIGSEGV inside libcuda.so.580. The test runs without the folders that hold one.
ld_test=$(tr ':' '\n' <<<"${LD_LIBRARY_PATH:-}" | while read -r d; do
    [ -n "$d" ] && [ ! -e "$d/libcuda.so.1" ] && echo "$d"; done | paste -sd:)
LD_LIBRARY_PATH="$ld_test" SITS_REQUIRE_BPF=1 timeout -k 5 120 "$PY" -m pytest -q \
    -p no:cacheprovider --tb=short tests/integration/test_cuda_probes.py >"$OUT/pytest.log" 2>&1
test_rc=$?
grep -E "passed|failed|error|Error|assert" "$OUT/pytest.log" | tail -8
timeout -k 10 300 "$PY" -X faulthandler tests/gpu/scenario.py --out "$OUT" "$@" 2>&1 | tee "$OUT/scenario.log"
scenario_rc=$?
[ "$test_rc" -eq 0 ] || echo "test_cuda_probes.py failed (rc=$test_rc): see $OUT/pytest.log"
exit $((test_rc != 0 || scenario_rc != 0))
