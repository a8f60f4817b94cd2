"""The unit started for real by systemd: a container booted with systemd-nspawn (systemd as its
PID 1, the host's kernel, the host's /usr bound read-only, this checkout bound at its own path),
`sits-trace install-service` inside it, a TLS server run as another dynamic user, curl, and the
spans read back from the JSONL file the service writes. Also: `systemctl reload` (SIGHUP) turns
the JSONL exporter on without a restart, `systemctl stop` flushes, the sandbox holds for the
running process (read-only /usr and /etc, seccomp, no new privileges, a non-root uid, exactly
the unit's capabilities), `systemd-analyze verify` is clean and `systemd-analyze security`
scores at most 4.0 inside the booted container.

Needs root, `systemd-nspawn` (Debian: systemd-container), a merged /usr host (/bin -> usr/bin)
and the kernel headers under /usr (BCC compiles against them). docs/systemd.md shows a run."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from .harness import SITS, free_port, make_cert

pytestmark = pytest.mark.bpf

REPO = Path(__file__).resolve().parents[2]
UNIT = REPO / "systemd" / "sits-trace.service"
SPANS = "/var/log/sits-trace/spans.jsonl"
# nspawn's own seccomp filter refuses bpf() and perf_event_open() unless told otherwise, and
# its default capability set lacks CAP_BPF/CAP_PERFMON: both must be passed through
NSPAWN_FLAGS = ["--register=no", "--keep-unit", "--bind-ro=/usr", f"--bind-ro={REPO}",
                "--bind=/sys/kernel/tracing", "--capability=CAP_BPF,CAP_PERFMON",
                "--system-call-filter=bpf perf_event_open", "--console=read-only", "--boot"]


def why_not() -> str | None:
    if os.geteuid() != 0:
        return "needs root"
    if not shutil.which("systemd-nspawn"):
        return "systemd-nspawn missing (apt-get install systemd-container)"
    if not shutil.which("capsh"):
        return "capsh missing (apt-get install libcap2-bin)"
    if not Path("/bin").is_symlink() or not Path("/usr/lib/systemd/systemd").exists():
        return "needs a merged-/usr host with systemd installed (its /usr is the container's)"
    if not Path("/sys/kernel/tracing/events").is_dir():
        return "tracefs is not mounted at /sys/kernel/tracing"
    return None


def make_root(root: Path) -> None:
    """The smallest root systemd boots: /usr is the host's (bound), the rest is written here."""
    for d in ("etc/systemd/system", "usr", "var", "tmp", "root", "srv", "run", "proc", "sys",
              "dev"):
        (root / d).mkdir(parents=True, exist_ok=True)
    for link in ("bin", "sbin", "lib", "lib64"):
        if Path("/" + link).is_symlink():
            (root / link).symlink_to(os.readlink("/" + link))
    etc = root / "etc"
    (etc / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n"
                                "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n")
    (etc / "group").write_text("root:x:0:\nnogroup:x:65534:\n")
    (etc / "nsswitch.conf").write_text("passwd: files systemd\ngroup: files systemd\n"
                                       "hosts: files\n")
    (etc / "hostname").write_text("sits-nspawn\n")
    (etc / "machine-id").write_text("")  # systemd writes a transient one
    shutil.copy("/usr/lib/os-release", etc / "os-release")
    (etc / "systemd/system/default.target").symlink_to(
        "/usr/lib/systemd/system/multi-user.target")


class Container:
    def __init__(self, root: Path, proc: subprocess.Popen[bytes], log: Path) -> None:
        self.root, self.proc, self.log = root, proc, log
        self.leader = 0

    def find_leader(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            kids = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
            pids = kids.read_text().split() if kids.exists() else []
            if pids and Path(f"/proc/{pids[0]}/comm").read_text().strip() == "systemd":
                self.leader = int(pids[0])
                return
            time.sleep(0.2)
        raise TimeoutError("the container's systemd did not start: " + self.log.read_text()[-3000:])

    def sh(self, *cmd: str, check: bool = True, timeout: float = 120
           ) -> subprocess.CompletedProcess[str]:
        r = subprocess.run(["nsenter", "-t", str(self.leader), "-a", *cmd], capture_output=True,
                           text=True, timeout=timeout, check=False)
        if check and r.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)}: rc={r.returncode}\n{r.stdout}\n{r.stderr}")
        return r

    def system_state(self) -> str:
        """Empty while the manager's socket is not up yet."""
        return self.sh("systemctl", "is-system-running", "--wait", check=False).stdout.strip()

    def prop(self, unit: str, name: str) -> str:
        return self.sh("systemctl", "show", "-p", name, "--value", unit).stdout.strip()

    def journal(self, unit: str) -> str:
        return self.sh("journalctl", "-u", unit, "-o", "cat", "--no-pager").stdout


@contextmanager
def booted() -> Iterator[Container]:
    with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="sits-nspawn-") as d:
        root, log = Path(d) / "root", Path(d) / "console.log"
        make_root(root)
        with log.open("wb") as out:
            proc = subprocess.Popen(["systemd-nspawn", "-D", str(root),
                                     f"--machine=sits-{os.getpid()}", *NSPAWN_FLAGS],
                                    stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL)
        box = Container(root, proc, log)
        try:
            box.find_leader()
            wait_for("boot", lambda: box.system_state() in ("running", "degraded"))
            yield box
        finally:
            proc.send_signal(signal.SIGTERM)  # nspawn asks the container's systemd to shut down
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def wait_for(what: str, probe: Any, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if probe():
            return
        time.sleep(0.3)
    raise TimeoutError(what)


def spans(box: Container) -> list[dict[str, Any]]:
    text = box.sh("cat", SPANS, check=False).stdout
    return [json.loads(x) for x in text.splitlines() if x.strip()]


def with_path(box: Container, path: str) -> list[dict[str, Any]]:
    return [s for s in spans(box) if s["attributes"].get("url.path") == path]


def unit_caps() -> set[str]:
    line = next(x for x in UNIT.read_text().splitlines() if x.startswith("AmbientCapabilities="))
    return set(line.split("=", 1)[1].split())


def cap_names(mask: int) -> set[str]:
    out = subprocess.run(["capsh", f"--decode={mask:x}"], capture_output=True, text=True,
                         check=True).stdout
    return {c.upper() for c in out.strip().split("=", 1)[1].split(",") if c}


def test_the_unit_under_systemd_traces_reloads_and_stops() -> None:
    reason = why_not()
    if reason:
        pytest.skip(reason)
    with booted() as box:
        r = box.sh(SITS, "install-service")
        out = r.stdout + r.stderr
        assert "enabled and started sits-trace.service" in out, out
        # Type=notify: `enable --now` returned after READY=1, sent once the probes attached
        assert box.prop("sits-trace", "ActiveState") == "active"
        assert box.prop("sits-trace", "StatusText") == "tracing"
        pid_in_box = box.prop("sits-trace", "MainPID")
        host_pid = _host_pid(box, int(pid_in_box))
        status = Path(f"/proc/{host_pid}/status").read_text()
        field = dict(x.split(":\t", 1) for x in status.splitlines() if ":\t" in x)
        assert int(field["Uid"].split()[0]) != 0  # DynamicUser
        assert field["NoNewPrivs"].strip() == "1"
        assert field["Seccomp"].strip() == "2"  # SystemCallFilter, MemoryDenyWriteExecute, ...
        assert cap_names(int(field["CapEff"], 16)) == unit_caps()
        assert cap_names(int(field["CapBnd"], 16)) == unit_caps()
        # ProtectSystem=strict as the running service sees its file system
        for path in ("/usr/sits-probe", "/etc/sits-probe"):
            touched = subprocess.run(["nsenter", "-t", str(host_pid), "-m", "touch", path],
                                     capture_output=True, text=True, check=False)
            assert touched.returncode != 0 and "Read-only file system" in touched.stderr

        # a TLS server as another (dynamic) user: uprobes on its libssl, its /proc via ptrace
        (box.root / "srv/web").mkdir()
        key, crt = make_cert(box.root / "srv/web")
        key.chmod(0o644)
        port = free_port()
        # DynamicUser implies a private /tmp: a checkout there (CI's) is bound back in
        box.sh("systemd-run", "--unit=sits-web", "-p", "DynamicUser=yes",
               "-p", f"BindReadOnlyPaths={REPO}", "/usr/bin/python3",
               str(REPO / "examples/demo_server.py"), str(port), f"/srv/web/{key.name}",
               f"/srv/web/{crt.name}")
        wait_for("web server", lambda: box.sh("curl", "-sk", "-o", "/dev/null",
                                              f"https://127.0.0.1:{port}/up",
                                              check=False).returncode == 0)

        # the installed config exports nothing; SIGHUP (ExecReload) turns the JSONL file on
        conf = box.root / "etc/sits-trace/config.toml"
        text = conf.read_text()
        assert 'jsonl_path = ""' in text
        conf.write_text(text.replace('jsonl_path = ""', f'jsonl_path = "{SPANS}"', 1))
        main_before = box.prop("sits-trace", "MainPID")
        box.sh("systemctl", "reload", "sits-trace")
        wait_for("reload", lambda: "configuration reloaded" in box.journal("sits-trace"))
        assert box.prop("sits-trace", "MainPID") == main_before  # reloaded, not restarted

        path = f"/nspawn-{uuid.uuid4().hex[:8]}"
        for _ in range(3):
            box.sh("curl", "-sk", "--max-time", "10", f"https://127.0.0.1:{port}{path}")
        wait_for("spans in the JSONL file", lambda: len(
            [s for s in with_path(box, path) if s["kind"] == "SERVER"]) >= 3)
        mine = with_path(box, path)
        assert {s["kind"] for s in mine} == {"SERVER", "CLIENT"}
        assert all(s["attributes"]["tls"] is True for s in mine)  # libssl uprobes fired
        assert {s["attributes"]["http.response.status_code"] for s in mine} == {200}

        # the read-only API socket, root reading a dynamic user's daemon
        top = json.loads(box.sh(SITS, "top", "--once", "--json", "--socket",
                                "/run/sits-trace/api.sock").stdout)
        assert top["source"] == "daemon"
        assert any(r["route"] == path for r in top["routes"]), top["routes"]

        # the control API (mode advise by default) serves from the runtime directory
        box.sh("test", "-S", "/run/sits-trace/control.sock")

        # stop flushes: requests sent just before `systemctl stop` are in the file after it
        last = f"/stop-{uuid.uuid4().hex[:8]}"
        for _ in range(5):
            box.sh("curl", "-sk", "--max-time", "10", f"https://127.0.0.1:{port}{last}")
        box.sh("systemctl", "stop", "sits-trace")
        assert box.prop("sits-trace", "Result") == "success"
        assert box.prop("sits-trace", "ExecMainStatus") == "0"
        assert len([s for s in with_path(box, last) if s["kind"] == "SERVER"]) == 5
        log = box.journal("sits-trace")
        for bad in ("Invalid argument", "Permission denied", "Operation not permitted",
                    "Traceback"):
            assert bad not in log, log

        verify = box.sh("systemd-analyze", "verify", "/etc/systemd/system/sits-trace.service",
                        check=False)
        assert verify.returncode == 0 and "sits-trace" not in verify.stdout + verify.stderr, \
            verify.stdout + verify.stderr
        security = box.sh("systemd-analyze", "security", "--no-pager", "sits-trace.service",
                          check=False).stdout
        m = re.search(r"Overall exposure level for sits-trace.service: ([0-9.]+) (\w+)", security)
        assert m and float(m.group(1)) <= 4.0, security
        print(f"\nsystemd-analyze security (inside the container): {m.group(1)} {m.group(2)}")


def _host_pid(box: Container, pid_in_box: int) -> int:
    """The host's pid of the container's process `pid_in_box` (NSpid: outer first)."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            status = (d / "status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("NSpid:"):
                ids = line.split()[1:]
                if len(ids) == 2 and int(ids[1]) == pid_in_box and _in_box(box, int(ids[0])):
                    return int(ids[0])
    raise LookupError(pid_in_box)


def _in_box(box: Container, host_pid: int) -> bool:
    try:
        return os.readlink(f"/proc/{host_pid}/ns/pid") == os.readlink(
            f"/proc/{box.leader}/ns/pid")
    except OSError:
        return False


# Each directive tried from inside the unit's own sandbox: the result is what the kernel says.
PROBE = r'''
import ctypes, errno, json, mmap, os, socket
libc = ctypes.CDLL(None, use_errno=True)
out = {}
try:
    mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    out["wx_mmap"] = "allowed"
except OSError as e:
    out["wx_mmap"] = errno.errorcode[e.errno]
for name, fam in (("af_packet", socket.AF_PACKET), ("af_inet", socket.AF_INET),
                  ("af_netlink", socket.AF_NETLINK)):
    try:
        socket.socket(fam, socket.SOCK_RAW if fam == socket.AF_PACKET else socket.SOCK_DGRAM).close()
        out[name] = "allowed"
    except OSError as e:
        out[name] = errno.errorcode[e.errno]
for path in ("/usr/probe", "/etc/probe", "/run/sits-trace/probe", "/var/log/sits-trace/probe"):
    try:
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))
        os.unlink(path)
        out[path] = "writable"
    except OSError as e:
        out[path] = errno.errorcode[e.errno]
buf = ctypes.create_string_buffer(16)
rc = libc.syscall(154, 0, buf, 16)  # modify_ldt: @cpu-emulation, unprivileged elsewhere
out["modify_ldt"] = "allowed" if rc >= 0 else errno.errorcode[ctypes.get_errno()]
rc = libc.personality(0x0008)  # LockPersonality: only the current one may be set
out["personality"] = "allowed" if rc >= 0 else errno.errorcode[ctypes.get_errno()]
rc = libc.syscall(321, 0, 0, 0)  # bpf(BPF_MAP_CREATE, NULL, 0): EINVAL from the kernel
out["bpf"] = "allowed" if rc >= 0 else errno.errorcode[ctypes.get_errno()]
print(json.dumps(out))
'''


def test_the_units_sandbox_holds() -> None:
    """The unit's own [Service] settings, ExecStart replaced by a probe: W+X memory, raw packet
    sockets, writes outside the unit's directories, a filtered system call and a personality
    change are refused; bpf() and the exporters' socket families are not."""
    reason = why_not()
    if reason:
        pytest.skip(reason)
    with booted() as box:
        (box.root / "srv/probe.py").write_text(PROBE)
        text = UNIT.read_text()
        text = re.sub(r"(?m)^ExecStart=.*$", "ExecStart=/usr/bin/python3 /srv/probe.py", text)
        text = re.sub(r"(?m)^(Type=notify|WatchdogSec=.*|ExecReload=.*)$", "", text)
        text = text.replace("[Service]", "[Service]\nType=oneshot\nRemainAfterExit=yes", 1)
        (box.root / "etc/systemd/system/sits-probe.service").write_text(text)
        box.sh("systemctl", "daemon-reload")
        box.sh("systemctl", "start", "sits-probe")
        log = box.journal("sits-probe")
        line = next((x for x in log.splitlines() if x.startswith("{")), None)
        assert line, log
        got = json.loads(line)
        print("\n" + json.dumps(got, indent=1))
        assert got["wx_mmap"] == "EPERM"  # MemoryDenyWriteExecute
        assert got["af_packet"] == "EAFNOSUPPORT"  # RestrictAddressFamilies
        assert got["af_inet"] == got["af_netlink"] == "allowed"
        assert got["/usr/probe"] == got["/etc/probe"] == "EROFS"  # ProtectSystem=strict
        assert got["/run/sits-trace/probe"] == got["/var/log/sits-trace/probe"] == "writable"
        assert got["modify_ldt"] == "EPERM"  # SystemCallFilter=~@cpu-emulation
        assert got["personality"] == "EPERM"  # LockPersonality
        assert got["bpf"] == "EINVAL"  # the kernel judged it (size 0): the filter let it by


RESERVE_PROBE = r"""
import json, sys, time
from sits_trace.analyzers.control.deadline import DeadlineReserver
served = int(open("/srv/served.pid").read())
r = DeadlineReserver()
try:
    got = r.apply(r.plan("cpu_starvation", served))
    print(json.dumps({"reserved_cpus": got.cpus}), flush=True)
    r.revert(served)
except Exception as e:
    print(json.dumps({"reserve_error": str(e)}), flush=True)
"""
SPIN = "import time\nwhile True:\n t = time.perf_counter()\n while time.perf_counter() - t < 0.003: pass\n time.sleep(0.02)"


def _reserve_as_unit(box: Container, name: str, dropin: str | None) -> dict[str, Any]:
    """The unit's [Service] (and the act drop-in's) with ExecStart replaced by a reservation
    of the served process's busy thread; what the probe printed."""
    from sits_trace.agent.service import render_unit

    python = REPO / ".venv" / "bin" / "python"
    text = render_unit(REPO / ".venv" / "bin" / "sits-trace")
    text = re.sub(r"(?m)^ExecStart=.*$", f"ExecStart={python} /srv/reserve.py", text)
    text = re.sub(r"(?m)^(Type=notify|WatchdogSec=.*|ExecReload=.*)$", "", text)
    text = text.replace("[Service]", "[Service]\nType=oneshot\nRemainAfterExit=yes", 1)
    unit_dir = box.root / "etc/systemd/system"
    (unit_dir / f"{name}.service").write_text(text)
    if dropin is not None:
        (unit_dir / f"{name}.service.d").mkdir(exist_ok=True)
        (unit_dir / f"{name}.service.d/act.conf").write_text(dropin)
    box.sh("systemctl", "daemon-reload")
    box.sh("systemctl", "start", name, check=False)
    log = box.journal(name)
    line = next((x for x in log.splitlines() if x.startswith("{")), None)
    assert line, log
    return dict(json.loads(line))


def test_the_act_drop_in_lets_the_service_reserve_cpu() -> None:
    """Under systemd, the unit with `sits-trace-act.conf` (root, CAP_SYS_NICE) gives another
    service's busy thread a SCHED_DEADLINE reservation and takes it back, RestrictRealtime=yes
    and all; the unit alone is refused (EPERM). The cgroup half of act (throttles) is
    tested in test_service_privileges.py: this container's cgroup v1 hierarchies are the
    container's, not the host's."""
    reason = why_not()
    if reason:
        pytest.skip(reason)
    with booted() as box:
        (box.root / "srv/reserve.py").write_text(RESERVE_PROBE)
        box.sh("systemd-run", "--unit=sits-served", "-p", "DynamicUser=yes", "/usr/bin/python3",
               "-c", SPIN)
        wait_for("served", lambda: box.prop("sits-served", "MainPID") not in ("", "0"))
        (box.root / "srv/served.pid").write_text(box.prop("sits-served", "MainPID"))
        time.sleep(0.5)
        dropin = (REPO / "systemd/sits-trace-act.conf").read_text()
        act = _reserve_as_unit(box, "sits-act-probe", dropin)
        assert float(act.get("reserved_cpus", 0)) > 0, act
        plain = _reserve_as_unit(box, "sits-plain-probe", None)
        assert "Operation not permitted" in str(plain.get("reserve_error")), plain
        # the unit keeps RestrictRealtime=yes: systemd filters sched_setscheduler, not the
        # sched_setattr the reservation uses
        assert box.prop("sits-act-probe", "RestrictRealtime") == "yes"
        verify = box.sh("systemd-analyze", "verify", "sits-act-probe.service", check=False)
        assert "act.conf" not in verify.stdout + verify.stderr, verify.stdout + verify.stderr
