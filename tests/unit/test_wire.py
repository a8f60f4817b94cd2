"""The wire contract, read from the C text (no root): every struct and enum of bpf/ is mirrored
in agent/capture/wire.py or declared kernel-only, with the same field names in the same order
and the same enum values. tests/integration/test_layout.py checks sizes and offsets with BCC."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import pytest
from sits_trace.agent.capture import wire

BPF = Path(__file__).resolve().parents[2] / "bpf"
_STRUCT = re.compile(r"^struct (\w+) \{(.*?)^\};", re.M | re.S)
_ENUM = re.compile(r"^enum (\w+) \{(.*?)\};", re.M | re.S)
_COMMENT = re.compile(r"/\*.*?\*/", re.S)
_FIELD = re.compile(r"^\s*(?:struct\s+)?[\w ]+?\s+(\w+)(?:\[[^\]]*\])?;", re.M)


def _sources() -> dict[str, str]:
    return {p.name: _COMMENT.sub("", p.read_text()) for p in sorted(BPF.iterdir())
            if p.suffix in (".c", ".h")}


def _structs() -> dict[str, tuple[str, list[str]]]:
    out: dict[str, tuple[str, list[str]]] = {}
    for name, text in _sources().items():
        for m in _STRUCT.finditer(text):
            out[m.group(1)] = (name, _FIELD.findall(m.group(2)))
    return out


def _enums() -> dict[str, tuple[str, dict[str, int]]]:
    out: dict[str, tuple[str, dict[str, int]]] = {}
    for name, text in _sources().items():
        for m in _ENUM.finditer(text):
            values: dict[str, int] = {}
            nxt = 0
            for item in (i.strip() for i in m.group(2).split(",")):
                if not item:
                    continue
                const, _, val = (s.strip() for s in item.partition("="))
                nxt = int(val, 0) if val else nxt
                values[const] = nxt
                nxt += 1
            out[m.group(1)] = (name, values)
    return out


def test_the_c_text_is_parsed() -> None:
    # the parser must find what it checks (a regex that matched nothing would pass anything)
    assert {"conn_event", "data_event", "tcp_event", "cuda_copy_event"} <= set(_structs())
    assert {"sits_kind", "sits_tcp_total", "cuda_api"} <= set(_enums())
    assert _enums()["cuda_api"][1]["CA_MEM_UNMAP"] == 52


def test_every_struct_is_mirrored_or_kernel_only() -> None:
    found = _structs()
    assert set(found) == set(wire.STRUCTS) | wire.KERNEL_ONLY
    assert not set(wire.STRUCTS) & wire.KERNEL_ONLY


@pytest.mark.parametrize("name", sorted(wire.STRUCTS))
def test_struct_fields_in_c_order(name: str) -> None:
    file, mirror = wire.STRUCTS[name]
    c_file, c_fields = _structs()[name]
    assert c_file == file
    py_fields = [f[0] for f in mirror._fields_]
    if name == "data_event":  # the mirror is the header: the payload array follows it
        assert c_fields == [*py_fields, "payload"]
    else:
        assert c_fields == py_fields


def test_every_enum_is_mirrored_with_its_values() -> None:
    found = _enums()
    assert set(found) == set(wire.ENUMS) | wire.KERNEL_ONLY_ENUMS
    for name, e in wire.ENUMS.items():
        c_file, values = found[name]
        assert c_file == e.file, name
        assert set(values) == set(e.members) | set(e.sentinels), name
        for const, member in e.members.items():
            assert values[const] == int(member), (name, const)
        assert set(e.members.values()) == set(e.py), name  # no Python-only member


def test_constants_match_the_defines() -> None:
    text = "\n".join(_sources().values())
    for macro, value in wire.CONSTANTS.items():
        if macro == "TASK_COMM_LEN":  # from the kernel's linux/sched.h
            continue
        m = re.search(rf"^#define {macro} (\S+)", text, re.M)
        assert m is not None, macro
        assert int(m.group(1), 0) == value, macro


def test_header_size_is_the_struct_module_size() -> None:
    from sits_trace.agent.capture import events

    assert wire.DATA_HDR_SIZE == ctypes.sizeof(wire.DataEventHdrC) == events._DATA_HDR.size
