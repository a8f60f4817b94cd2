"""Span ids come from a pool of random bytes read a block at a time."""

from __future__ import annotations

from sits_trace.agent.tracing.spans import RandomPool, SpanBuilder


def test_pool_hands_out_consecutive_slices_and_refills() -> None:
    reads: list[int] = []
    counter = iter(range(1, 10_000))

    def read(n: int) -> bytes:
        reads.append(n)
        return bytes(next(counter) % 256 for _ in range(n))

    pool = RandomPool(size=32, read=read)
    got = [pool(8) for _ in range(4)]
    assert reads == [32] and b"".join(got) == bytes(range(1, 33))
    assert pool(16) == bytes(range(33, 49)) and reads == [32, 32]  # refilled, not split
    assert len(pool(100)) == 100 and reads[-1] == 100  # a request above the block size


def test_default_pool_gives_distinct_ids() -> None:
    pool = RandomPool()
    ids = {pool(16) for _ in range(2000)}
    assert len(ids) == 2000 and all(len(i) == 16 for i in ids)


def test_hex_hands_out_the_same_bytes_as_text() -> None:
    counter = iter(range(1, 10_000))

    def read(n: int) -> bytes:
        return bytes(next(counter) % 256 for _ in range(n))

    pool = RandomPool(size=32, read=read)
    got = [pool.hex(8), pool(8).hex(), pool.hex(16)]  # text and bytes share one position
    assert "".join(got) == bytes(range(1, 33)).hex()
    assert pool.hex(16) == bytes(range(33, 49)).hex()  # the next block: refilled, not split
    assert pool.hex(100) == bytes(x % 256 for x in range(65, 165)).hex()


def test_span_ids_come_from_the_pool_as_hex_and_are_never_all_zero() -> None:
    b = SpanBuilder(clock_offset_ns=0)
    ids = {b._random_hex(16) for _ in range(2000)}
    assert len(ids) == 2000 and all(len(i) == 32 and int(i, 16) for i in ids)
    assert all(i == i.lower() for i in ids)
    b._pool = RandomPool(read=bytes)  # a pool of zeros: the id is read again, not zero
    got = b._random_hex(8)
    assert len(got) == 16 and int(got, 16) != 0
