"""The ctypes mirror in agent/capture/events.py matches the layout BCC derives from bpf/events.h."""

from __future__ import annotations

import ctypes

import pytest
from sits_trace.agent.capture import bpfsrc, events

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
