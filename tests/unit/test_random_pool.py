"""Span ids come from a pool of random bytes read a block at a time."""

from __future__ import annotations

from sits_trace.agent.tracing.spans import RandomPool


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
