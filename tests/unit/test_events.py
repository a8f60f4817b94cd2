from __future__ import annotations

import ctypes

import pytest
from sits_trace.agent.capture import events
from sits_trace.agent.model import Direction, Role


def _data_record(payload: bytes, **fields: int) -> bytes:
    h = events.DataEventHdrC()
    h.kind = events.Kind.DATA
    for k, v in fields.items():
        setattr(h, k, v)
    h.captured = len(payload)
    return bytes(h) + payload


def test_struct_fast_path_matches_ctypes_mirror() -> None:
    assert events._DATA_HDR.size == ctypes.sizeof(events.DataEventHdrC) == events.DATA_HDR_SIZE
    raw = _data_record(b"GET / HTTP/1.1\r\n\r\n", tgid=7, tid=8, conn_id=2**40 + 3, fd=5,
                       ts_enter_ns=10, ts_exit_ns=20, ssl=0xABC, len=4000, direction=1, source=1,
                       role=2, runq_us=99)
    ev = events.decode(raw)
    assert isinstance(ev, events.DataEvent)
    assert (ev.pid, ev.tid, ev.conn_id, ev.fd, ev.ssl) == (7, 8, 2**40 + 3, 5, 0xABC)
    assert (ev.ts_enter_ns, ev.ts_exit_ns, ev.length) == (10, 20, 4000)
    assert ev.direction is Direction.EGRESS and ev.source is events.Source.TLS
    assert ev.role is Role.CLIENT and ev.runq_us == 99
    assert ev.payload == b"GET / HTTP/1.1\r\n\r\n"
    assert (ev.sample_shift, ev.gap, ev.lost, ev.tail) == (0, False, False, False)
    for flags, want in ((3 | 0x80, (3, True, False, False)), (0x40, (0, False, True, False)),
                        (0x20 | 1, (1, False, False, True))):
        e = events.decode(_data_record(b"x", tgid=7, len=1, flags=flags, runq_us=5))
        assert isinstance(e, events.DataEvent)
        assert (e.sample_shift, e.gap, e.lost, e.tail) == want and e.runq_us == 5


def test_conn_event_addresses() -> None:
    c = events.ConnEventC()
    c.kind, c.tgid, c.conn_id, c.fd, c.role = events.Kind.CONN_OPEN, 3, 9, 4, 1
    c.family, c.peer_port = events.AF_INET6, 443
    c.peer_addr[:] = list(bytes(10) + b"\xff\xff" + bytes([10, 0, 0, 7]))
    c.comm = b"nginx"
    ev = events.decode(bytes(c))
    assert isinstance(ev, events.ConnEvent)
    assert ev.peer_address == "10.0.0.7" and ev.peer_port == 443 and ev.comm == "nginx"
    assert ev.role is Role.SERVER


@pytest.mark.parametrize("raw", [b"", b"\x03\x00", b"\x63\x00\x00\x00" + bytes(80),
                                 _data_record(b"x" * 10)[:-3],
                                 _data_record(b"", direction=7)])
def test_malformed_records_raise_decode_error(raw: bytes) -> None:
    with pytest.raises(events.DecodeError):
        events.decode(raw)
