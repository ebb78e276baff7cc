"""An emulated multi-host cluster on one Linux machine, for multi-process JAX benchmarks.

Each emulated host is a network namespace holding one JAX process (``D`` CPU
devices); hosts reach each other through a Linux bridge whose links are shaped
with ``tc tbf`` in both directions, so cross-host collectives (gloo over TCP)
see a NIC of ``link_gbit`` Gbit/s per host, full duplex, while traffic inside a
host never leaves the process or the namespace's loopback.

Topology of one cluster (``S`` is the per-cluster prefix ``mp<pid>n<seq>``)::

    netns Sh0: lo, eth0 10.213.0.1/24 ==veth== h0 --+
    netns Sh1: lo, eth0 10.213.0.2/24 ==veth== h1 --+-- br0   (h<i> and br0 live in netns Sbr)
    ...                                             |

Invariants:
  * Every namespace and every ``/etc/netns/<name>`` directory a cluster
    creates is named with its prefix ``S``, unique per (process, cluster), so
    parallel runs never collide; teardown removes exactly those.
  * The bridge lives in its own namespace with no uplink and the hosts have no
    default route: emulated traffic cannot reach the machine's real network,
    and the root namespace is left untouched (no links, no firewall hooks).
  * Both ends of each host's veth pair carry a tbf qdisc at the same rate:
    ``eth0`` egress shapes what the host sends, ``h<i>`` egress (bridge side)
    shapes what it receives.
  * Every child process is bounded in time and dies with the harness.

Parent side::

    ok, why = EmulatedCluster.available()
    with EmulatedCluster(num_hosts=2, devices_per_host=4, link_gbit=1.0) as cluster:
        rate = cluster.measure_link_rate()          # bytes/s of TCP payload
        results = cluster.run(["-m", "benchmarks.my_bench", "--size", "64"],
                              env={"PYTHONPATH": "<repo root>"})

Child side (before any other JAX call), run as a module from the repo root::

    from benchmarks.emulated_cluster import initialize_from_env
    initialize_from_env()

A child runs inside its host's namespace, so :func:`interface_counters` reads
its own host's link (``HOST_INTERFACE``): the bytes it sent and received over
the emulated network, headers included.

``benchmarks/resharding/real_worker.py`` is a complete child.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from types import FrameType
from typing import IO, Any

__all__ = [
    "ENV_COORDINATOR",
    "ENV_DEVICES_PER_HOST",
    "ENV_INIT_TIMEOUT_S",
    "ENV_NUM_PROCESSES",
    "ENV_PROCESS_ID",
    "ClusterRunError",
    "ClusterTimeoutError",
    "EmulatedCluster",
    "HOST_INTERFACE",
    "initialize_from_env",
    "interface_counters",
]

ENV_PROCESS_ID = "MESHPAR_PROCESS_ID"
ENV_NUM_PROCESSES = "MESHPAR_NUM_PROCESSES"
ENV_COORDINATOR = "MESHPAR_COORDINATOR"
ENV_DEVICES_PER_HOST = "MESHPAR_DEVICES_PER_HOST"
ENV_INIT_TIMEOUT_S = "MESHPAR_INIT_TIMEOUT_S"

# Each host's end of its link; every byte it exchanges with another host crosses it.
HOST_INTERFACE = "eth0"
_SUBNET = "10.213.0."  # a /24 that exists only inside this cluster's namespaces
_MAX_HOSTS = 253
_COORDINATOR_BASE_PORT = 12300
_PROBE_PORT = 5201
# Burst: 1 ms at line rate, at least 256 KiB. tbf needs a whole 64 KiB GSO
# super-packet plus credit to ride out timer slack; at 5 Gbit/s a 16 KB burst
# gets 46% of the rate, 1 ms gets 94%. It is also free credit: a transfer of
# B bytes runs burst/B faster than the rate (0.5% for 48 MB at 1 Gbit/s).
_TBF_BURST_S = 1e-3
_TBF_MIN_BURST_BYTES = 256 * 1024
# Queue depth before tbf drops: enough that TCP (bbr or cubic) never idles
# the link, including when several hosts send to one (the bridge-side qdisc).
_TBF_LATENCY_MS = 20
# After one host's process fails the others usually block in a collective
# forever; give them this long to report their own error, then kill them.
_FAILURE_GRACE_S = 5.0
_CMD_TIMEOUT_S = 30.0
_STALE_NAME = re.compile(r"^mp(\d+)n\d+(?:h\d+|br)$")

_log = logging.getLogger(__name__)
_seq_lock = threading.Lock()
_seq = 0


class ClusterRunError(RuntimeError):
    """A run where some host's process failed; ``results`` has every host's output."""

    def __init__(self, message: str, results: list[subprocess.CompletedProcess[str]]) -> None:
        super().__init__(message)
        self.results = results


class ClusterTimeoutError(ClusterRunError):
    """A run that overran its time bound; all its processes were killed."""


def initialize_from_env() -> None:
    """Joins this process to the emulated cluster described by the MESHPAR_* variables.

    Must run before anything touches a JAX backend. Sets ``jax_num_cpu_devices``
    to the devices per host, then calls :func:`meshpar.distributed.initialize`
    against the coordinator on host 0: gloo as the CPU collectives, and a
    cross-host transfer server on this host's emulated address, so both
    ``meshpar.reshard`` executors (``"collective"`` and ``"p2p"``) and
    cross-host ``jax.device_put`` work.
    """
    # Imported here so the parent side (which only manages namespaces) never
    # pays for, or depends on, importing JAX.
    import jax

    try:
        process_id = int(os.environ[ENV_PROCESS_ID])
        num_processes = int(os.environ[ENV_NUM_PROCESSES])
        coordinator = os.environ[ENV_COORDINATOR]
        devices_per_host = int(os.environ[ENV_DEVICES_PER_HOST])
        init_timeout_s = int(os.environ[ENV_INIT_TIMEOUT_S])
    except KeyError as e:
        raise RuntimeError(
            f"initialize_from_env: {e.args[0]} is not set; run this under EmulatedCluster.run"
        ) from None
    import meshpar.distributed

    jax.config.update("jax_num_cpu_devices", devices_per_host)
    meshpar.distributed.initialize(
        coordinator,
        num_processes,
        process_id,
        initialization_timeout=init_timeout_s,
    )


def interface_counters(interface: str = HOST_INTERFACE, sys_class_net: str = "/sys/class/net") -> dict[str, int]:
    """``{"tx_bytes", "rx_bytes"}``: bytes ``interface`` has sent and received since it was made,
    as the kernel counts them (whole frames: Ethernet, IP and TCP headers included).

    Inside a host's namespace (a child of :meth:`EmulatedCluster.run`) the default is that host's
    link. Monotonic while the interface exists: the bytes of an interval are the difference of
    two reads.

    Raises:
      OSError: no such interface (outside an emulated host, ``eth0`` may not exist).
      ValueError: a counter file that does not hold one non-negative integer.
    """
    out = {}
    for name in ("tx_bytes", "rx_bytes"):
        with open(os.path.join(sys_class_net, interface, "statistics", name)) as f:
            text = f.read().strip()
        if not text.isdigit():
            raise ValueError(f"{interface} {name}: expected a byte count, got {text!r}")
        out[name] = int(text)
    return out


class EmulatedCluster:
    """``num_hosts`` network namespaces joined by shaped links; one JAX process per host.

    Use as a context manager: namespaces exist between ``__enter__`` and
    ``__exit__`` and are also removed at interpreter exit or on SIGTERM/SIGHUP.
    Requires root, ``ip``/``tc`` (iproute2) and ``unshare`` (util-linux); check
    :meth:`available` first.

    Attributes:
      num_hosts, devices_per_host, link_gbit: as given.
      timeout_s: default time bound of :meth:`run`.
      host_addresses: ``host_addresses[i]`` is host ``i``'s address on the
        emulated network.
      namespaces: ``namespaces[i]`` is host ``i``'s network namespace.
    """

    def __init__(
        self,
        num_hosts: int,
        devices_per_host: int,
        link_gbit: float = 1.0,
        timeout_s: float = 300.0,
    ) -> None:
        if not 1 <= num_hosts <= _MAX_HOSTS:
            raise ValueError(f"num_hosts: expected 1..{_MAX_HOSTS}, got {num_hosts}")
        if devices_per_host < 1:
            raise ValueError(f"devices_per_host: expected >= 1, got {devices_per_host}")
        if not link_gbit > 0:  # also rejects NaN
            raise ValueError(f"link_gbit: expected a positive rate, got {link_gbit!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s: expected a positive number of seconds, got {timeout_s!r}")
        self.num_hosts = num_hosts
        self.devices_per_host = devices_per_host
        self.link_gbit = float(link_gbit)
        self.timeout_s = float(timeout_s)
        prefix = _new_prefix()
        self._bridge_ns = f"{prefix}br"
        self.namespaces = tuple(f"{prefix}h{i}" for i in range(num_hosts))
        self.host_addresses = tuple(f"{_SUBNET}{i + 1}" for i in range(num_hosts))
        self._runs = 0
        self._created: list[str] = []
        self._old_handlers: dict[int, Any] = {}

    # -- availability ------------------------------------------------------

    @staticmethod
    def available() -> tuple[bool, str]:
        """Whether this machine can host an emulated cluster, and if not, why.

        Beyond root and the tools, actually builds a throwaway namespace with a
        bridge, a veth pair and a tbf qdisc, since containers often lack the
        capability or the kernel modules.
        """
        if os.geteuid() != 0:
            return False, "emulated cluster needs root (network namespaces, tc)"
        missing = [t for t in ("ip", "tc", "unshare", "hostname") if shutil.which(t) is None]
        if missing:
            return False, (
                f"emulated cluster needs {', '.join(missing)} on PATH "
                "(apt-get install iproute2 util-linux hostname)"
            )
        ns = f"{_new_prefix()}br"
        try:
            for cmd in (
                ["ip", "netns", "add", ns],
                ["ip", "-n", ns, "link", "add", "name", "br0", "type", "bridge"],
                ["ip", "-n", ns, "link", "add", "name", "va", "type", "veth", "peer", "name", "vb"],
                ["ip", "-n", ns, "link", "set", "vb", "master", "br0"],
                ["tc", "-n", ns, "qdisc", "add", "dev", "va", "root", *_tbf_args(1.0)],
            ):
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=_CMD_TIMEOUT_S)
                if r.returncode != 0:
                    return False, f"emulated cluster probe failed: {' '.join(cmd)}: {r.stderr.strip()}"
        except (OSError, subprocess.TimeoutExpired) as e:
            return False, f"emulated cluster probe failed: {e}"
        finally:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=_CMD_TIMEOUT_S)
        return True, "ok"

    # -- lifecycle ---------------------------------------------------------

    def __enter__(self) -> EmulatedCluster:
        ok, why = self.available()
        if not ok:
            raise RuntimeError(why)
        _remove_stale_namespaces()
        atexit.register(self.close)
        # Signal handlers can only be set from the main thread; a signal the
        # program ignores should stay ignored.
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGHUP):
                if signal.getsignal(sig) is not signal.SIG_IGN:
                    self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Kills this cluster's processes and deletes its namespaces; idempotent."""
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers.clear()
        atexit.unregister(self.close)
        # Host namespaces first: deleting one destroys its veth pair, so the
        # bridge namespace is empty by the time it goes.
        for ns in reversed(self._created):
            _delete_namespace(ns)
        self._created.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Unwind through ``with`` blocks so __exit__ tears down; the previous
        # handler, if any, runs after we are gone.
        previous = self._old_handlers.get(signum)
        self.close()
        if callable(previous):
            previous(signum, frame)
        else:
            raise SystemExit(128 + signum)

    def _build(self) -> None:
        br = self._bridge_ns
        self._add_namespace(br)
        _sh("ip", "-n", br, "link", "add", "name", "br0", "type", "bridge")
        _sh("ip", "-n", br, "link", "set", "br0", "up")
        hosts_file = "127.0.0.1 localhost\n" + "".join(
            f"{addr} {_hostname(i)}\n" for i, addr in enumerate(self.host_addresses)
        )
        for i, (ns, addr) in enumerate(zip(self.namespaces, self.host_addresses, strict=True)):
            self._add_namespace(ns)
            # `ip netns exec` bind-mounts /etc/netns/<ns>/* over /etc/*, which
            # is how each host resolves its own hostname to its veth address
            # (gloo advertises whatever the hostname resolves to).
            etc = f"/etc/netns/{ns}"
            os.makedirs(etc, exist_ok=True)
            with open(f"{etc}/hosts", "w") as f:
                f.write(hosts_file)
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            # Created directly inside the two namespaces so the interface
            # names never pass through (and collide in) the root namespace.
            _sh("ip", "-n", ns, "link", "add", "name", HOST_INTERFACE, "type", "veth",
                "peer", "name", f"h{i}", "netns", br)
            _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", HOST_INTERFACE)
            _sh("tc", "-n", ns, "qdisc", "add", "dev", HOST_INTERFACE, "root", *_tbf_args(self.link_gbit))
            _sh("tc", "-n", br, "qdisc", "add", "dev", f"h{i}", "root", *_tbf_args(self.link_gbit))
            _sh("ip", "-n", br, "link", "set", f"h{i}", "master", "br0", "up")
            _sh("ip", "-n", ns, "link", "set", HOST_INTERFACE, "up")

    def _add_namespace(self, ns: str) -> None:
        _sh("ip", "netns", "add", ns)
        self._created.append(ns)

    # -- running -----------------------------------------------------------

    def run(
        self,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
        check: bool = True,
    ) -> list[subprocess.CompletedProcess[str]]:
        """Runs ``python *argv`` once per host, all at once, and waits for all.

        ``argv`` is what follows the interpreter: ``["script.py", ...]`` or
        ``["-m", "pkg.mod", ...]``. Each process inherits this environment plus
        ``env`` plus the MESHPAR_* variables (read by :func:`initialize_from_env`),
        and runs under its host's hostname. Returns one result per host, in
        host order, with decoded stdout/stderr.

        Raises:
          ClusterTimeoutError: not all processes finished within ``timeout_s``
            (default: the cluster's); all were killed.
          ClusterRunError: ``check`` and some process exited non-zero. Once one
            fails, the rest get a few seconds to exit before being killed.
        """
        if not self._created:
            raise RuntimeError("run: the cluster is not set up; use it inside `with`")
        timeout_s = self.timeout_s if timeout_s is None else float(timeout_s)
        # A fresh port per run: the previous coordinator's socket may linger.
        coordinator = f"{self.host_addresses[0]}:{_COORDINATOR_BASE_PORT + self._runs}"
        self._runs += 1
        cmd_tail = [sys.executable, *argv]
        procs: list[subprocess.Popen[bytes]] = []
        logs: list[tuple[IO[bytes], IO[bytes]]] = []
        # Output goes to files, not pipes: nothing has to drain H pipes while
        # waiting, and a killed process still leaves what it wrote.
        with contextlib.ExitStack() as files:
            try:
                for i, ns in enumerate(self.namespaces):
                    child_env = {**os.environ, **(env or {})}
                    child_env.update({
                        ENV_PROCESS_ID: str(i),
                        ENV_NUM_PROCESSES: str(self.num_hosts),
                        ENV_COORDINATOR: coordinator,
                        ENV_DEVICES_PER_HOST: str(self.devices_per_host),
                        ENV_INIT_TIMEOUT_S: str(max(1, int(timeout_s))),
                    })
                    out = files.enter_context(tempfile.TemporaryFile())
                    err = files.enter_context(tempfile.TemporaryFile())
                    procs.append(
                        subprocess.Popen(
                            _in_host(ns, _hostname(i), cmd_tail),
                            env=child_env,
                            stdin=subprocess.DEVNULL,
                            stdout=out,
                            stderr=err,
                            start_new_session=True,
                            preexec_fn=_die_with_parent,
                        )
                    )
                    logs.append((out, err))
                timed_out = _wait_all(procs, time.monotonic() + timeout_s)
            finally:
                for p in procs:
                    _kill_group(p)
                    p.wait()
            results = [
                subprocess.CompletedProcess(p.args, p.returncode, _read(out), _read(err))
                for p, (out, err) in zip(procs, logs, strict=True)
            ]
        if timed_out:
            raise ClusterTimeoutError(
                f"run: {argv!r} on {self.num_hosts} hosts did not finish within {timeout_s:.0f}s; "
                f"killed all processes\n{_summary(results)}",
                results,
            )
        if check and any(r.returncode != 0 for r in results):
            raise ClusterRunError(f"run: {argv!r} failed\n{_summary(results)}", results)
        return results

    def run_reporting(self, args: Sequence[str], *, env: Mapping[str, str], timeout_s: float, progress: Any,
                      what: str) -> list[str]:
        """:meth:`run` while ``progress`` reports as the hosts go; returns errors instead of raising.

        ``progress`` is an unstarted ``threading.Thread`` with a ``stop`` event
        and a ``poll()`` method (a last report after the run).
        """
        errors: list[str] = []
        progress.start()
        try:
            self.run(args, env=env, timeout_s=timeout_s)
        except ClusterRunError as e:
            errors.append(f"{what} failed: {e}")
            print(f"ERROR: {e}", file=sys.stderr, flush=True)
        finally:
            progress.stop.set()
            progress.join()
        progress.poll()
        return errors

    def measure_link_rate(
        self, src: int = 0, dst: int = 1, nbytes: int = 48 << 20, timeout_s: float = 60.0
    ) -> float:
        """TCP payload bytes/s from host ``src`` to host ``dst`` over one connection.

        Sends ``nbytes`` to ``dst``'s emulated address; with ``src == dst``
        that address is local, so this measures the namespace's loopback path
        (what intra-host traffic gets). Timed by the receiver from its first
        byte to the last, excluding connection setup. Expect ~95% of
        ``link_gbit`` across hosts: tbf counts Ethernet/IP/TCP headers.
        """
        for h in (src, dst):
            if not 0 <= h < self.num_hosts:
                raise ValueError(f"measure_link_rate: host {h} is not in this {self.num_hosts}-host cluster")
        if not self._created:
            raise RuntimeError("measure_link_rate: the cluster is not set up; use it inside `with`")
        addr = self.host_addresses[dst]
        cmds = [
            _in_namespace(self.namespaces[dst], [sys.executable, "-c", _RECEIVER, addr, str(_PROBE_PORT)]),
            _in_namespace(
                self.namespaces[src],
                [sys.executable, "-c", _SENDER, addr, str(_PROBE_PORT), str(nbytes), str(timeout_s)],
            ),
        ]
        procs: list[subprocess.Popen[str]] = []
        try:
            for cmd in cmds:
                procs.append(
                    subprocess.Popen(
                        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                        start_new_session=True, preexec_fn=_die_with_parent,
                    )
                )
            receiver, sender = procs
            deadline = time.monotonic() + timeout_s
            out, recv_err = receiver.communicate(timeout=timeout_s)
            send_err = sender.communicate(timeout=max(0.0, deadline - time.monotonic()))[1]
        except subprocess.TimeoutExpired:
            raise RuntimeError(
                f"measure_link_rate: {nbytes} bytes from host {src} to {dst} took over {timeout_s:.0f}s"
            ) from None
        finally:
            for p in procs:
                _kill_group(p)
                p.wait()
        if receiver.returncode != 0 or sender.returncode != 0:
            raise RuntimeError(
                f"measure_link_rate: transfer failed: receiver: {recv_err.strip()}; sender: {send_err.strip()}"
            )
        return float(json.loads(out)["bytes_per_s"])


# -- helpers ----------------------------------------------------------------

_RECEIVER = r"""
import json, socket, sys, time
with socket.create_server((sys.argv[1], int(sys.argv[2]))) as srv:
    conn, _ = srv.accept()
    with conn:
        buf = bytearray(1 << 20)
        first = conn.recv_into(buf)
        t0 = time.perf_counter()
        rest = 0
        while n := conn.recv_into(buf):
            rest += n
        dt = time.perf_counter() - t0
print(json.dumps({"bytes_per_s": rest / dt, "bytes": first + rest, "seconds": dt}))
"""

_SENDER = r"""
import socket, sys, time
addr, port, nbytes, timeout = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
chunk = memoryview(bytes(1 << 20))
deadline = time.monotonic() + timeout
while True:  # the receiver starts concurrently and may not be listening yet
    try:
        s = socket.create_connection((addr, port), timeout=timeout)
        break
    except ConnectionRefusedError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.01)
with s:
    while nbytes > 0:
        s.sendall(chunk[: min(nbytes, len(chunk))])
        nbytes -= len(chunk)
    s.shutdown(socket.SHUT_WR)
    s.recv(1)
"""


def _tbf_args(link_gbit: float) -> list[str]:
    rate_bytes = link_gbit * 1e9 / 8
    burst = max(_TBF_MIN_BURST_BYTES, int(rate_bytes * _TBF_BURST_S))
    return ["tbf", "rate", f"{link_gbit * 1e3:g}mbit", "burst", str(burst), "latency", f"{_TBF_LATENCY_MS}ms"]


def _hostname(i: int) -> str:
    return f"host{i}"


def _in_namespace(ns: str, cmd: Sequence[str]) -> list[str]:
    return ["ip", "netns", "exec", ns, *cmd]


def _in_host(ns: str, hostname: str, cmd: Sequence[str]) -> list[str]:
    # `ip netns exec`, `unshare` and `sh -c 'exec'` all exec in place, so the
    # Popen pid is the Python process itself.
    return _in_namespace(
        ns,
        ["unshare", "--uts", "--", "sh", "-c", 'hostname "$1" && shift && exec "$@"', "sh", hostname, *cmd],
    )


def _sh(*cmd: str) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=_CMD_TIMEOUT_S)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()}")


_libc = ctypes.CDLL(None, use_errno=True)
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    # Survives the execs into ip/unshare/sh/python (none are setuid), so a
    # SIGKILLed harness does not leave JAX processes spinning in namespaces.
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _kill_group(p: subprocess.Popen[Any]) -> None:
    if p.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)


def _wait_all(procs: list[subprocess.Popen[bytes]], deadline: float) -> bool:
    """Waits until all processes exit, or one failed a grace period ago; True on deadline."""
    give_up_at = float("inf")
    while True:
        codes = [p.poll() for p in procs]
        now = time.monotonic()
        if all(c is not None for c in codes) or now >= give_up_at:
            return False
        if now >= deadline:
            return True
        if give_up_at == float("inf") and any(c not in (None, 0) for c in codes):
            give_up_at = now + _FAILURE_GRACE_S
        time.sleep(0.05)


def _read(f: IO[bytes]) -> str:
    f.seek(0)
    return f.read().decode(errors="replace")


def _summary(results: list[subprocess.CompletedProcess[str]], tail: int = 2000) -> str:
    return "\n".join(
        f"--- host {i}: exit {r.returncode}\n{r.stderr[-tail:]}" for i, r in enumerate(results)
    )


def _new_prefix() -> str:
    """``mp<pid>n<seq>``: unique among live processes, and names its creator for stale cleanup."""
    global _seq
    with _seq_lock:
        _seq += 1
        return f"mp{os.getpid()}n{_seq - 1}"


def _delete_namespace(ns: str) -> None:
    # A namespace outlives `ip netns del` while any process is inside it, so
    # its processes (all ours, by the naming invariant) go first.
    pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=_CMD_TIMEOUT_S)
    for pid in pids.stdout.split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)
    r = subprocess.run(["ip", "netns", "del", ns], capture_output=True, text=True, timeout=_CMD_TIMEOUT_S)
    if r.returncode != 0:
        _log.warning("could not delete network namespace %s: %s", ns, r.stderr.strip())
    shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)


def _remove_stale_namespaces() -> None:
    """Deletes namespaces left by harness processes that no longer exist (e.g. SIGKILLed)."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=_CMD_TIMEOUT_S)
    for name in (line.split(" ", 1)[0] for line in listed.stdout.splitlines()):
        m = _STALE_NAME.match(name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            _delete_namespace(name)
