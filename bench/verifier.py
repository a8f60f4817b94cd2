"""How much of the kernel verifier's budget each probe program takes (run as root).

    .venv/bin/python bench/verifier.py                 # http.c's tracepoints and tls.c's uprobes
    .venv/bin/python bench/verifier.py --exit-args 0   # reads and writes at enter and exit

The verifier walks every path of a program, up to 1,000,000 instructions; a program near that
fails to load after a small change elsewhere (an inlined helper, a new field). Prints, per
program, the instructions it verified (`verified_insns` of bpf_prog_info, kernel >= 5.16).
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LIMIT = 1_000_000
_INFO_SIZE = 232  # struct bpf_prog_info up to attach_btf_id (uapi/linux/bpf.h)
_VERIFIED_INSNS = 216  # offset of verified_insns in it


def verified_insns(fd: int) -> int:
    from bcc import lib

    buf = ctypes.create_string_buffer(_INFO_SIZE)
    n = ctypes.c_uint32(_INFO_SIZE)
    lib.bpf_obj_get_info.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint32)]
    if lib.bpf_obj_get_info(fd, buf, ctypes.byref(n)) != 0:
        raise OSError(ctypes.get_errno(), "bpf_obj_get_info failed")
    return int.from_bytes(buf.raw[_VERIFIED_INSNS:_VERIFIED_INSNS + 4], "little")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--exit-args", type=int, choices=(0, 1), default=1,
                    help="SITS_EXIT_ARGS: 1 as loaded on x86-64 (reads and writes traced at "
                         "their exit alone), 0 the fallback")
    args = ap.parse_args()
    try:
        from bcc import BPF
    except ImportError:
        print("verifier: BCC (python3-bpfcc) is missing", file=sys.stderr)
        return 2
    from sits_trace.agent.capture import bpfsrc

    b = BPF(text=bpfsrc.program_text(["http.c", "tls.c"]), cflags=bpfsrc.cflags({"SITS_EXIT_ARGS": args.exit_args}))
    try:
        for name in ("sits_ssl_exit", "sits_bio_write", "sits_ssl_read_enter", "sits_ssl_set_bio"):
            b.load_func(name.encode(), BPF.KPROBE)
        rows = sorted(((verified_insns(fn.fd), fn.name.decode()) for fn in b.funcs.values()),
                      reverse=True)
    finally:
        b.cleanup()
    print("| program | verified instructions | of the 1M limit |")
    print("|---|---|---|")
    for insns, name in rows:
        print(f"| {name} | {insns} | {insns / LIMIT:.1%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
