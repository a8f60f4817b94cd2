#!/bin/bash
# Do CET user shadow stacks get turned on here, and do uretprobes survive them?
# (docs/gpu.md, Known limits.) Run as root with BCC importable (source .gpubundle/activate.sh):
#   bash tests/gpu/cet.sh
# Builds a small program with gcc's defaults (on Ubuntu: -fcf-protection, CET-marked), runs it
# with glibc's defaults and with GLIBC_TUNABLES=glibc.cpu.x86_shstk=on, printing its own
# x86_Thread_features; then runs it again under a uretprobe on its function f and prints the
# exit status (-11: SIGSEGV).
set -u
PY=${PY:-/opt/torch/.venv/bin/python3}
ldd --version | head -1
grep -q -w user_shstk /proc/cpuinfo && echo "cpu: user_shstk" || echo "cpu: no user_shstk flag"
d=$(mktemp -d)
cat >"$d/p.c" <<'C'
#include <stdio.h>
#include <string.h>
__attribute__((noinline)) int f(int x) { __asm__ volatile("" ::: "memory"); return x + 1; }
int main(void) {
    int s = 0;
    for (int i = 0; i < 100000; i++) s = f(s);
    char l[256];
    FILE *st = fopen("/proc/self/status", "r");
    while (fgets(l, sizeof l, st))
        if (!strncmp(l, "x86_Thread_features", 19)) fputs(l, stdout);
    printf("f ran %d times\n", s);
    return 0;
}
C
gcc -O1 -o "$d/p" "$d/p.c" || exit 1
readelf -n "$d/p" | grep -i "x86 feature" || echo "binary: no x86 feature note"
echo "-- glibc defaults:"; "$d/p"
echo "-- GLIBC_TUNABLES=glibc.cpu.x86_shstk=on:"; GLIBC_TUNABLES=glibc.cpu.x86_shstk=on "$d/p"
"$PY" - "$d/p" <<'PYEOF'
import os, subprocess, sys
from bcc import BPF
exe = sys.argv[1]
b = BPF(text="BPF_ARRAY(n, u64, 1); int ret(void *ctx) { int k = 0; n.increment(k); return 0; }")
b.attach_uretprobe(name=exe, sym="f", fn_name="ret")
for env in ({}, {"GLIBC_TUNABLES": "glibc.cpu.x86_shstk=on"}):
    b["n"].clear()
    p = subprocess.run([exe], env={**os.environ, **env}, capture_output=True, text=True)
    hits = sum(v.value for v in b["n"].values())
    print(f"-- under a uretprobe on f, env={env or 'default'}: rc={p.returncode} "
          f"uretprobe hits={hits} out={p.stdout.strip()!r}")
PYEOF
