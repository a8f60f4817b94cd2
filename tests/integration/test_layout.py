"""The wire mirror (agent/capture/wire.py) matches the layout BCC derives from bpf/, and each
bpf/*.c compiles on its own with the headers it includes."""

from __future__ import annotations

import ctypes

import pytest
from sits_trace.agent.capture import bpfsrc, events, wire

pytestmark = pytest.mark.bpf

LAYOUT_PROGRAM = """
#include "events.h"
BPF_ARRAY(layout_conn, struct conn_event, 1);
BPF_ARRAY(layout_data, struct data_event, 1);
BPF_ARRAY(layout_proc, struct proc_event, 1);
"""


def _offsets(cls: type[ctypes.Structure]) -> dict[str, tuple[int, int]]:
    return {name: (getattr(cls, name).offset, getattr(cls, name).size)
            for name, *_ in cls._fields_}


def test_mirror_matches_bcc(tmp_path: object) -> None:
    from bcc import BPF

    root = bpfsrc.bpf_dir()
    text = bpfsrc._inline("events.h", root, set()) + LAYOUT_PROGRAM.replace('#include "events.h"', "")
    b = BPF(text=text, cflags=bpfsrc.cflags({}))
    try:
        pairs = [("layout_conn", events.ConnEventC), ("layout_data", events.DataEventHdrC),
                 ("layout_proc", events.ProcEventC)]
        for map_name, mirror in pairs:
            derived = b[map_name].Leaf
            got = _offsets(derived)
            want = _offsets(mirror)
            for field, (off, size) in want.items():
                if field == "_pad":
                    continue
                assert got[field][0] == off, (map_name, field, got[field], off)
                assert got[field][1] == size, (map_name, field, got[field], size)
        data = b["layout_data"].Leaf
        assert ctypes.sizeof(data) == events.DATA_HDR_SIZE + 4096
        assert ctypes.sizeof(b["layout_conn"].Leaf) == ctypes.sizeof(events.ConnEventC)
    finally:
        b.cleanup()


# ---- every program on its own, and the whole wire contract (agent/capture/wire.py) ----

# which of wire.STRUCTS/ENUMS each program's compile checks: the file that defines them
_PROGRAMS = {"http.c": ("events.h", "sockio.h", "http.c"), "tls.c": ("tls.c",),
             "tcp.c": ("tcp.c",), "sched.c": ("sched.c",), "cuda.c": ("cuda.c",)}


def _program_defines(program: str) -> dict[str, int | str]:
    """The -D flags the agent itself passes for this program (tcp.c: from tracefs)."""
    if program == "tcp.c":
        from sits_trace.agent.capture.probes import tracefs_root
        from sits_trace.agent.signals.node import tcp_defines

        return tcp_defines(tracefs_root())
    return {}


def _probe_text(files: tuple[str, ...]) -> str:
    """BPF arrays whose leaf types carry what the compiler derived: a struct's layout, and each
    enum constant or define as the length (value + 1) of a char array."""
    out: list[str] = []
    for name, (file, _) in wire.STRUCTS.items():
        if file in files:
            out.append(f"BPF_ARRAY(layout_s_{name}, struct {name}, 1);")
    for name, e in wire.ENUMS.items():
        if e.file in files:
            fields = " ".join(f"char v_{c.lower()}[{c} + 1];" for c in e.members)
            out.append(f"struct sits_probe_{name} {{ {fields} }};")
            out.append(f"BPF_ARRAY(layout_e_{name}, struct sits_probe_{name}, 1);")
    if "events.h" in files:
        fields = " ".join(f"char v_{c.lower()}[{c} + 1];" for c in wire.CONSTANTS
                          if c != "RUNQ_SLOTS")
        out.append(f"struct sits_probe_defines {{ {fields} }};")
        out.append("BPF_ARRAY(layout_defines, struct sits_probe_defines, 1);")
    return "\n".join(out) + "\n"


@pytest.mark.parametrize("program", sorted(_PROGRAMS))
def test_program_compiles_alone_and_matches_the_wire_mirror(program: str) -> None:
    from bcc import BPF

    files = _PROGRAMS[program]
    text = bpfsrc.program_text([program]) + _probe_text(files)
    b = BPF(text=text, cflags=bpfsrc.cflags(_program_defines(program)))
    try:
        checked = 0
        for name, (file, mirror) in wire.STRUCTS.items():
            if file not in files:
                continue
            derived = b[f"layout_s_{name}"].Leaf
            got, want = _offsets(derived), _offsets(mirror)
            for field, (off, size) in want.items():
                assert got[field] == (off, size), (name, field, got[field], (off, size))
            extra = ctypes.sizeof(derived) - ctypes.sizeof(mirror)
            assert extra == (4096 if name == "data_event" else 0), (name, extra)
            checked += 1
        for name, e in wire.ENUMS.items():
            if e.file not in files:
                continue
            leaf = b[f"layout_e_{name}"].Leaf
            for const, member in e.members.items():
                assert getattr(leaf, f"v_{const.lower()}").size - 1 == int(member), (name, const)
            checked += 1
        if "events.h" in files:
            leaf = b["layout_defines"].Leaf
            for const, value in wire.CONSTANTS.items():
                if const != "RUNQ_SLOTS":
                    assert getattr(leaf, f"v_{const.lower()}").size - 1 == value, const
        assert checked or program == "tls.c"  # tls.c defines no record of its own
    finally:
        b.cleanup()
