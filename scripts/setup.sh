#!/bin/bash
# Set up sits-trace on a fresh Debian 12 machine, as root. Idempotent: a second run is quick.
#  - Debian's BCC (python3-bpfcc) and the test peers (nginx, prometheus, wrk, hey, stress-ng...)
#  - systemd-container (systemd-nspawn: the unit under a real systemd, test_systemd_nspawn)
#  - kernel headers: the running kernel's if Debian has them, else the newest Debian headers
#    linked at /lib/modules/$(uname -r)/{build,source} (tracepoint and uprobe programs compile
#    against them because tracepoint argument structs come from tracefs)
#  - tracefs and debugfs mounted
#  - .venv from Debian's /usr/bin/python3 with --system-site-packages (so `import bcc` works),
#    with the project installed editable
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "setup: run as root (sudo make setup)" >&2; exit 1; }
kver=$(uname -r)
pkgs=(python3-bpfcc bpfcc-tools python3-venv python3-dev nginx-light prometheus wrk hey stress-ng
      iproute2 curl openssl procps systemd-container libcap2-bin)
missing=()
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
have_headers() { [ -e "/lib/modules/$kver/build/Makefile" ] || [ -e "/lib/modules/$kver/build/include" ]; }
if ! have_headers && ! ls -d /usr/src/linux-headers-*-amd64 >/dev/null 2>&1; then missing+=(HEADERS); fi
if [ ${#missing[@]} -gt 0 ]; then
    echo "setup: installing ${missing[*]}"
    apt-get update -qq
    export DEBIAN_FRONTEND=noninteractive
    inst=()
    for p in "${missing[@]}"; do [ "$p" = HEADERS ] || inst+=("$p"); done
    if [[ " ${missing[*]} " == *" HEADERS "* ]]; then
        if apt-cache show "linux-headers-$kver" >/dev/null 2>&1; then inst+=("linux-headers-$kver");
        else inst+=(linux-headers-amd64); fi
    fi
    apt-get install -y -qq --no-install-recommends "${inst[@]}" >/dev/null
fi
# Debian starts nginx and prometheus on install; the tests start their own
for svc in nginx prometheus; do
    if pgrep -x "$svc" >/dev/null 2>&1 && [ -n "$(command -v systemctl)" ]; then systemctl stop "$svc" 2>/dev/null || true; fi
done
if ! have_headers; then
    hdr=$(ls -d /usr/src/linux-headers-*-amd64 | sort -V | tail -1)
    common=$(ls -d /usr/src/linux-headers-*-common | sort -V | tail -1)
    mkdir -p "/lib/modules/$kver"
    ln -sfn "$hdr" "/lib/modules/$kver/build"
    ln -sfn "$common" "/lib/modules/$kver/source"
    echo "setup: linked $hdr for kernel $kver"
fi
mountpoint -q /sys/kernel/tracing || mount -t tracefs nodev /sys/kernel/tracing
mountpoint -q /sys/kernel/debug || mount -t debugfs nodev /sys/kernel/debug 2>/dev/null || true
if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c 'import bcc' 2>/dev/null; then
    rm -rf .venv
    /usr/bin/python3 -m venv --system-site-packages .venv
    .venv/bin/pip install -q --upgrade pip
fi
stamp=.venv/.sits-installed
if [ ! -e "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    .venv/bin/pip install -q -e '.[test]'
    touch "$stamp"
fi
.venv/bin/python scripts/build_native.py  # the agent's hot path in C (mypyc); Python if it can't
.venv/bin/python -c 'import bcc, sits_trace.agent' && echo "setup: ok (.venv ready; bcc importable)"
