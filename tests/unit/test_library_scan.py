"""How the agent finds the libraries to probe in a process (agent/capture/probes.py): the maps
read once per look, each library's several mappings resolved once, a container's paths seen
through its root, and an executable's symbol table read once per file, not per look (every
traced process is looked at every `trace.library_rescan_s`)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from sits_trace.agent.capture import probes
from sits_trace.agent.capture.probes import (
    elf_exports,
    libraries_in,
    mapped_libraries,
    read_maps,
    ssl_executable,
)

PID = 4242


def _proc(tmp_path: Path, lines: list[str]) -> tuple[str, Path]:
    root = tmp_path / "proc"
    (root / str(PID)).mkdir(parents=True)
    (root / str(PID) / "maps").write_text("".join(f"{x}\n" for x in lines))
    return str(root), root


def test_libraries_are_found_once_each_with_container_paths_through_the_root(
        tmp_path: Path) -> None:
    host = tmp_path / "host"
    host.mkdir()
    (host / "libssl.so.3").write_bytes(b"not an elf")
    (host / "libcrypto.so.3").write_bytes(b"not an elf")
    lib, crypto = host / "libssl.so.3", host / "libcrypto.so.3"
    root, _ = _proc(tmp_path, [
        "55d0a000-55d0b000 r--p 00000000 08:01 100 /usr/sbin/nginx",
        f"7f000000-7f001000 r--p 00000000 08:01 200 {lib}",
        f"7f001000-7f002000 r-xp 00001000 08:01 200 {lib}",
        f"7f002000-7f003000 r--p 00002000 08:01 200 {lib}",
        f"7f003000-7f004000 rw-p 00003000 08:01 200 {lib}",
        f"7f010000-7f011000 r--p 00000000 08:01 300 {crypto}",
        "7f020000-7f021000 rw-p 00000000 00:00 0 ",
        "7f030000-7f031000 r--p 00000000 08:01 500 /opt/app/libssl_helper.so",
        "7f040000-7f041000 r-xp 00000000 08:01 600 /app/lib/libssl.so.1.1",  # a container's
        "7f050000-7f051000 r-xp 00000000 08:01 700 /app/lib/libssl-3.so",
    ])
    maps = read_maps(PID, root)
    assert libraries_in(maps, PID, "libssl", root) == [
        os.path.realpath(lib),
        os.path.realpath(f"{root}/{PID}/root/app/lib/libssl.so.1.1"),
        os.path.realpath(f"{root}/{PID}/root/app/lib/libssl-3.so"),
    ]
    assert libraries_in(maps, PID, "libcrypto", root) == [os.path.realpath(crypto)]
    assert libraries_in(maps, PID, "libcuda", root) == []
    assert mapped_libraries(PID, "libssl", root) == libraries_in(maps, PID, "libssl", root)
    assert read_maps(PID + 1, root) == b"" and mapped_libraries(PID + 1, "libssl", root) == []
    # a process that maps libssl is not asked whether its program carries OpenSSL
    assert ssl_executable(PID, root, maps) is None


def test_a_program_carrying_openssl_is_found_and_its_symbols_read_once_per_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    exe = tmp_path / "node"
    exe.write_bytes(b"v1")
    root, proc = _proc(tmp_path, [f"55d0a000-55d0b000 r-xp 00000000 08:01 100 {exe}"])
    (proc / str(PID) / "exe").symlink_to(exe)
    reads: list[str] = []

    def defines(f, name: bytes) -> bool:  # type: ignore[no-untyped-def]
        reads.append(f.read().decode())
        return name == b"SSL_read"

    monkeypatch.setattr(probes, "_defines", defines)
    monkeypatch.setattr(probes, "_exports", {})
    assert ssl_executable(PID, root) == os.path.realpath(exe)
    assert ssl_executable(PID, root, read_maps(PID, root)) == os.path.realpath(exe)
    assert elf_exports(str(exe), "SSL_read") and not elf_exports(str(exe), "SSL_write_ex")
    assert reads == ["v1", "v1"]  # once per (file, symbol)
    exe.write_bytes(b"v2 longer")  # replaced (an upgrade): read again
    assert elf_exports(str(exe), "SSL_read")
    assert reads == ["v1", "v1", "v2 longer"]
    assert not elf_exports(str(tmp_path / "gone"), "SSL_read")
    monkeypatch.setattr(probes, "_EXPORTS_MAX", 1)  # bounded: full, it starts again
    elf_exports(str(exe), "SSL_write_ex")
    assert len(probes._exports) == 1
