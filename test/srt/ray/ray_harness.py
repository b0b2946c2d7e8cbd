"""Process plumbing shared by the tests (``conftest.py``) and ``make demo``.

A private Ray head on loopback, the CPU arguments of the tiny-model server, a
health wait, and stopping processes by pid. Nothing here stops anything it did
not start: processes are found by a marker only they carry (the head's own
temp dir, the server's port), never by name, and ``ray stop`` is never used
(it would stop every Ray cluster on the host).
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional

import psutil
import requests

# The tiny model on this CPU-only machine (sglang 0.5.23).
CPU_SERVER_ARGS = [
    "--device", "cpu",
    "--model-impl", "transformers",
    "--attention-backend", "torch_native",
    "--disable-cuda-graph",
    "--max-total-tokens", "4096",
    "--dtype", "float32",  # the HF reference runs in float32 too
    "--host", "127.0.0.1",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def processes_with(marker: str) -> List[psutil.Process]:
    """Live processes (not this one, not zombies) whose command line contains
    ``marker``."""
    return _processes(lambda cmd: marker in cmd)


def _processes(match: Callable[[str], bool]) -> List[psutil.Process]:
    out = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if p.info["status"] == psutil.STATUS_ZOMBIE or p.pid == os.getpid():
                continue
            if match(" ".join(p.info["cmdline"] or [])):
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return out


def with_descendants(procs: List[psutil.Process]) -> List[psutil.Process]:
    """``procs`` and every process below them (Ray renames its workers and
    agents to ``ray::...``: only their parent carries the head's marker)."""
    seen = {p.pid: p for p in procs}
    for p in procs:
        try:
            for c in p.children(recursive=True):
                seen.setdefault(c.pid, c)
        except psutil.NoSuchProcess:
            pass
    return [p for p in seen.values() if p.pid != os.getpid()]


def stop_processes(procs: List[psutil.Process], timeout: float = 15) -> None:
    """SIGTERM, wait, then SIGKILL what is left."""
    for p in procs:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=timeout)


@dataclass
class RayHead:
    """A ``ray start --head`` of our own: loopback, own port, temp dir, token."""

    address: str
    temp_dir: str
    token: str
    namespace: str
    num_cpus: int
    _starting: Optional[subprocess.Popen] = None

    @property
    def env(self) -> Dict[str, str]:
        """Environment for any process that joins this cluster (Ray 2.60 heads
        use token authentication)."""
        return {
            "RAY_ADDRESS": self.address,
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": self.token,
        }

    @classmethod
    def launch(cls, num_cpus: int = 8, namespace: str = "sglang-test") -> "RayHead":
        """Start ``ray start --head`` in the background; :meth:`wait` for it."""
        port = free_port()
        # Short: Ray puts unix sockets under it (108-byte path limit).
        temp_dir = tempfile.mkdtemp(prefix="rt_", dir="/tmp")
        head = cls(
            address=f"127.0.0.1:{port}", temp_dir=temp_dir, token=secrets.token_hex(32),
            namespace=namespace, num_cpus=num_cpus,
        )
        cmd = [
            str(Path(sys.executable).parent / "ray"), "start", "--head",
            "--node-ip-address=127.0.0.1", f"--port={port}",
            f"--num-cpus={num_cpus}", "--num-gpus=0",
            "--include-dashboard=false", "--disable-usage-stats",
            f"--temp-dir={temp_dir}",
            # Ports that default to fixed numbers: two heads on one host (the
            # suite's and the demo's, or another session's) must not share them.
            f"--ray-client-server-port={free_port()}",
            f"--dashboard-agent-listen-port={free_port()}",
            f"--dashboard-port={free_port()}",
        ]
        head._starting = _ray_start(cmd, head)
        return head

    def wait(self, timeout: float = 120) -> "RayHead":
        proc, self._starting = self._starting, None
        if proc is not None:
            _finish_ray_start(proc, "--head", timeout, self.stop)
        return self

    def stop(self) -> None:
        """Stop every process of this head and remove its temp dir."""
        stop_processes(self.processes())
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def processes(self) -> List[psutil.Process]:
        """This head's processes: those that carry its temp dir, its Ray client
        server (which names only the head's port), and everything below them."""
        port = self.address.rsplit(":", 1)[1]

        def ours(cmd: str) -> bool:
            if self.temp_dir in cmd:
                return True
            return "ray.util.client.server" in cmd and any(
                a.startswith("--address=") and a.endswith(f":{port}") for a in cmd.split()
            )

        return with_descendants(_processes(ours))


@dataclass
class RayWorkerNode:
    """A second Ray node on this host, joined to a :class:`RayHead`: its own
    ``ray start --address=HEAD`` with another loopback IP (``127.0.0.2``), temp
    dir and ports, so Ray sees two nodes (two raylets, two node ids) that share
    one host, hostname and pid namespace. Stopped by the pids of the processes
    that carry its temp dir, like the head."""

    head: RayHead
    node_ip: str
    temp_dir: str
    num_cpus: int

    @classmethod
    def join(
        cls, head: RayHead, node_ip: str = "127.0.0.2", num_cpus: int = 2, timeout: float = 120, attempts: int = 2
    ) -> "RayWorkerNode":
        """Join ``head``; a ``ray start`` that fails (on a loaded box the head's GCS can miss the new node's
        deadline: "Failed to get node info ... Deadline Exceeded") is stopped and tried again, ``attempts`` in all."""
        for attempt in range(1, attempts + 1):
            try:
                return cls._join_once(head, node_ip, num_cpus, timeout)
            except RuntimeError:
                if attempt == attempts:
                    raise

    @classmethod
    def _join_once(cls, head: RayHead, node_ip: str, num_cpus: int, timeout: float) -> "RayWorkerNode":
        temp_dir = tempfile.mkdtemp(prefix="rtw_", dir="/tmp")
        node = cls(head=head, node_ip=node_ip, temp_dir=temp_dir, num_cpus=num_cpus)
        cmd = [
            str(Path(sys.executable).parent / "ray"), "start", f"--address={head.address}",
            f"--node-ip-address={node_ip}", f"--num-cpus={num_cpus}", "--num-gpus=0",
            "--disable-usage-stats", f"--temp-dir={temp_dir}",
            # Every port of its own: the head's node shares the host.
            f"--node-manager-port={free_port()}", f"--object-manager-port={free_port()}",
            f"--metrics-export-port={free_port()}", f"--runtime-env-agent-port={free_port()}",
            f"--dashboard-agent-listen-port={free_port()}",
            f"--dashboard-agent-grpc-port={free_port()}",
        ]
        # Returns once the raylet is up and registered with the head.
        _finish_ray_start(_ray_start(cmd, head), "--address", timeout, node.stop)
        return node

    def processes(self) -> List[psutil.Process]:
        return with_descendants(processes_with(self.temp_dir))

    def stop(self) -> None:
        stop_processes(self.processes())
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def _ray_start(cmd: List[str], head: RayHead) -> subprocess.Popen:
    """Run ``ray start`` ``cmd`` in the background, with this environment less
    any ``RAY_*`` setting, joining ``head`` (whose address is on ``cmd``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(head.env)
    env.pop("RAY_ADDRESS")
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish_ray_start(proc: subprocess.Popen, how: str, timeout: float, stop: Callable[[], None]) -> None:
    """Wait for ``ray start {how}`` to return; if it does not, or fails,
    ``stop()`` what it started and raise, with its output."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        stop()
        raise TimeoutError(f"`ray start {how}` did not finish within {timeout:.0f} s")
    if proc.returncode != 0:
        stop()
        raise RuntimeError(f"`ray start {how}` failed:\n{out}")


def start_ray_head(num_cpus: int = 8, namespace: str = "sglang-test") -> RayHead:
    return RayHead.launch(num_cpus, namespace).wait()


def wait_healthy(
    proc: subprocess.Popen,
    url: str,
    timeout: float,
    *,
    log: Callable[[], str] = lambda: "",
    on_wait: Optional[Callable[[float], None]] = None,
) -> float:
    """Poll ``url``/health until 200; raise if ``proc`` exits or time runs out.

    Returns the seconds waited. ``on_wait(seconds)`` is called about once a
    second (progress display)."""
    started = time.monotonic()
    while True:
        waited = time.monotonic() - started
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log()[-5000:]}")
        try:
            if requests.get(f"{url}/health", timeout=5).status_code == 200:
                return waited
        except requests.RequestException:
            pass
        if waited > timeout:
            raise TimeoutError(f"server not healthy in {timeout:.0f}s:\n{log()[-5000:]}")
        if on_wait is not None:
            on_wait(waited)
        time.sleep(1)
