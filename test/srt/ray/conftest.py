"""Real parts for the Ray backend tests: a Ray head, a tiny model, a CLI server.

* ``ray_head`` (session): ``ray start --head`` on loopback with its own port,
  temp dir, namespace and auth token (Ray 2.60 token auth stays on). It is
  stopped at the end by the pids of the processes that carry its temp dir —
  never ``ray stop``, which would stop every cluster on the host.
* ``ray_two_nodes`` (module): a cluster of its own with two Ray nodes on
  this host — a head and a worker joined to it with node IP ``127.0.0.2``
  (two raylets, two node ids, one hostname); stopped by pid like the head.
* ``tiny_model`` (session): a random-weight Llama + a tokenizer trained here.
* ``rdt_server`` (session): one weight-sync server from the CLI, shared by
  the end-to-end modules whose tests leave it consistent.
* ``launch_server``: runs ``python -m sglang.launch_server`` against the
  cluster and waits for ``/health``; stops it with SIGTERM (then SIGKILL).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import pytest
import requests

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
# Ray reads the auth mode when it is imported (test modules import it at
# collection time); the token itself is per head and set by `ray_head`.
os.environ["RAY_AUTH_MODE"] = "token"

from tiny_model import build_tiny_model  # noqa: E402
from waiting import wait_until  # noqa: E402,F401  (re-exported for the tests)

from sglang.srt.ray.rdt.engine.plan import TensorSpec  # noqa: E402
from sglang.srt.ray.rdt.engine.update_state import Writer  # noqa: E402
from sglang.srt.ray.rdt.transport.metadata import ReadResult  # noqa: E402

from ray_harness import (  # noqa: E402,F401  (re-exported for the tests)
    CPU_SERVER_ARGS,
    RayHead,
    RayWorkerNode,
    free_port,
    start_ray_head,
    wait_healthy,
)


@pytest.fixture(scope="session")
def ray_head():
    head = start_ray_head()
    saved = {k: os.environ.get(k) for k in head.env}
    os.environ.update(head.env)
    try:
        yield head
    finally:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        head.stop()


@pytest.fixture(scope="module")
def ray_two_nodes():
    """(head, worker): a two-node cluster of its own. Not connected from this
    process (the session's ``ray_client`` may be): drive it from Ray jobs."""
    head = RayHead.launch(num_cpus=2, namespace="sglang-two-nodes").wait()
    try:
        worker = RayWorkerNode.join(head, node_ip="127.0.0.2", num_cpus=2)
    except BaseException:
        head.stop()
        raise
    try:
        yield head, worker
    finally:
        worker.stop()
        head.stop()


@pytest.fixture(scope="session")
def ray_client(ray_head):
    """This test process connected to the head as a driver (for inspection)."""
    import ray

    ray.init(
        address=ray_head.address,
        namespace=ray_head.namespace,
        log_to_driver=False,
        logging_level="ERROR",
        # Workers import the test helpers (rdt_actors, tiny_model).
        runtime_env={"env_vars": {"PYTHONPATH": str(HERE)}},
    )
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def toy_rank(ray_client):
    """A ``ToyRank`` actor (``rdt_actors.py``: the receiver around a toy model)
    shared by one module's tests, killed after them."""
    from rdt_actors import ToyRank

    rank = ToyRank.remote(seed=0)
    yield rank
    ray_client.kill(rank)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


# --------------------------------------------------------------------------- #
# A pull source in this process (what a lane or a ref source is to a rank)
# --------------------------------------------------------------------------- #
TRAINER = Writer("process:a", "trainer process A")


class MemorySource:
    """A source whose tensors live in this process. ``fail_at``: raise after
    that many tensors landed (a sender that went away mid-read);
    ``threads``: the thread of every read, in order."""

    def __init__(self, tensors, writer=TRAINER, fail_at=None):
        self.tensors, self._writer, self.fail_at = list(tensors), writer, fail_at
        self.threads = []

    def specs(self, timeout_s):
        return [TensorSpec(tuple(t.shape), t.dtype) for t in self.tensors]

    def writer(self):
        return self._writer

    def read(self, targets, device, timeout_s, copy=True):
        self.threads.append(threading.get_ident())
        for i, (dst, src) in enumerate(zip(targets.tensors, self.tensors)):
            if i == self.fail_at:
                raise ConnectionError("the sender went away")
            if copy:
                dst.copy_(src)
        return ReadResult("memory", len(self.tensors), int(targets.nbytes.sum()), 0.0)


# --------------------------------------------------------------------------- #
# The real CLI server
# --------------------------------------------------------------------------- #
@dataclass
class Server:
    proc: subprocess.Popen
    port: int
    log_path: Path
    args: List[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def arg(self, flag: str) -> Optional[str]:
        """The value given to ``flag`` on the command line, if any."""
        return self.args[self.args.index(flag) + 1] if flag in self.args else None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def generate(self, prompt: str, max_new_tokens: int = 12, **extra) -> dict:
        r = requests.post(
            f"{self.url}/generate",
            json={
                "text": prompt,
                "sampling_params": {
                    "temperature": 0,
                    "max_new_tokens": max_new_tokens,
                    "ignore_eos": True,
                },
                **extra,
            },
            timeout=120,
        )
        r.raise_for_status()
        return r.json()

    def output_ids(self, prompt: str, max_new_tokens: int = 12) -> List[int]:
        return self.generate(prompt, max_new_tokens)["output_ids"]

    def terminate(self, timeout: float = 90) -> int:
        """SIGTERM the server and wait; SIGKILL its process group if it hangs."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        return self.proc.returncode


def start_server(
    model_path: Path,
    head: RayHead,
    extra_args: List[str],
    log_dir: Path,
    *,
    wait: bool = True,
    timeout: float = 480,  # generous: a loaded 2-core box starts slowly
    env: Optional[Dict[str, str]] = None,
    port: Optional[int] = None,
    idle_sleep: bool = True,
) -> Server:
    """A CPU server from the real CLI. ``idle_sleep``: its scheduler sleeps
    while idle (sglang's ``--sleep-on-idle``; a test server idles most of its
    life, and two idle schedulers spinning would take both cores of the CI
    box); False keeps sglang's default busy idle loop."""
    port = port or free_port()
    if idle_sleep and "--sleep-on-idle" not in extra_args:
        extra_args = [*extra_args, "--sleep-on-idle"]
    if (
        {"--enable-rdt-weight-sync", "--enable-engine-info-bootstrap"} & set(extra_args)
        and "--engine-info-bootstrap-port" not in extra_args
    ):
        # Default 6789 would clash between servers of one test session.
        extra_args = [*extra_args, "--engine-info-bootstrap-port", str(free_port())]
    args = [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", str(model_path), "--port", str(port),
        *CPU_SERVER_ARGS, *extra_args,
    ]
    log_path = log_dir / f"server-{port}.log"
    full_env = {**os.environ, **head.env, **(env or {})}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, env=full_env,
            start_new_session=True,
        )
    server = Server(proc=proc, port=port, log_path=log_path, args=args)
    if wait:
        try:
            wait_healthy(proc, server.url, timeout, log=server.log)
        except TimeoutError:
            server.terminate(timeout=10)
            raise
    return server


# The namespace of the shared weight-sync server (not the driver's, the head's).
RDT_SERVER_NAMESPACE = "rollout-e2e"


@pytest.fixture(scope="session")
def rdt_server(ray_head, ray_client, tiny_model, tmp_path_factory):
    """One ``--enable-rdt-weight-sync`` CLI server, in a namespace of its own
    and with ``--sleep-on-idle`` (an idle loop that sleeps in a poll, which
    weight-sync calls must wake), shared by the modules whose tests start
    from whatever consistent version it serves and leave a consistent one
    behind (test_update_safety, test_weight_sync_e2e)."""
    s = start_server(
        tiny_model, ray_head,
        ["--backend", "ray", "--enable-rdt-weight-sync", "--ray-namespace", RDT_SERVER_NAMESPACE,
         "--sleep-on-idle"],
        tmp_path_factory.mktemp("rdt-server"),
    )
    yield s
    s.terminate()


# sglang's own model code with LoRA served on the CPU (torch_native backend).
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_ARGS = ["--model-impl", "sglang", "--enable-lora", "--lora-backend", "torch_native", "--max-lora-rank", "8",
             "--max-loras-per-batch", "4", "--lora-target-modules", *LORA_TARGETS]


@pytest.fixture(scope="module")
def lora_server(ray_head, ray_client, tiny_model, tmp_path_factory):
    """A TP 1 CPU server with LoRA on (sglang's model code), in the head's namespace, for one module that pushes
    adapters and base weights to it (test_lora_sync, test_docs); gone with it, so that later modules find the
    cluster as they expect it (e.g. one placement group of their own)."""
    s = start_server(
        tiny_model, ray_head,
        ["--backend", "ray", "--enable-rdt-weight-sync", "--ray-namespace", ray_head.namespace, *LORA_ARGS],
        tmp_path_factory.mktemp("lora-server"),
    )
    yield s
    s.terminate()


@pytest.fixture(scope="module")
def tp2_server(ray_head, ray_client, tiny_model, tmp_path_factory):
    """A ``--tp-size 2`` CPU server (sglang's model code over gloo, one core
    per rank, LoRA on) for one module that drives a multi-rank engine
    (test_group_calls, test_lora_sync). Its schedulers keep sglang's busy idle
    loop, so it lives no longer than that module: it would slow every later one."""
    s = start_server(
        tiny_model, ray_head,
        ["--backend", "ray", "--enable-rdt-weight-sync", "--tp-size", "2", "--ray-namespace", ray_head.namespace,
         *LORA_ARGS],
        tmp_path_factory.mktemp("tp2-server"), env={"SGLANG_CPU_OMP_THREADS_BIND": "0|1"}, idle_sleep=False,
    )
    yield s
    s.terminate()


@pytest.fixture
def launch_server(ray_head, tiny_model, tmp_path):
    servers: List[Server] = []

    def launch(extra_args: List[str], **kwargs) -> Server:
        kwargs.setdefault("log_dir", tmp_path)
        server = start_server(kwargs.pop("model_path", tiny_model), kwargs.pop("head", ray_head), extra_args, **kwargs)
        servers.append(server)
        return server

    yield launch
    for s in servers:
        s.terminate()


# --------------------------------------------------------------------------- #
# Cluster inspection
# --------------------------------------------------------------------------- #
def live_actors(ray_mod, class_name: str = "SchedulerActor", namespace: Optional[str] = None):
    from ray._private import state

    out = []
    for a in state.actors().values():
        if a.get("ActorClassName") != class_name or a.get("State") == "DEAD":
            continue
        out.append(a)
    return out


def live_placement_groups(ray_mod):
    return [
        pg for pg in ray_mod.util.placement_group_table().values()
        if pg["state"] != "REMOVED"
    ]


# --------------------------------------------------------------------------- #
# Reporting: a CI run that is cut short still says why tests failed
# --------------------------------------------------------------------------- #
def pytest_runtest_logreport(report):
    """Print a failure's traceback as soon as it happens (pytest prints them only
    at the end of the session, which a CI time limit may never reach), and how
    long each slow phase took."""
    if report.failed:
        text = f"\n---- {report.nodeid} failed in {report.when} ({report.duration:.0f} s) ----\n"
        text += str(report.longrepr)[-6000:] + "\n"
        sys.stderr.write(text)
        sys.stderr.flush()
    elif report.duration > 60:
        sys.stderr.write(f"\n[{report.when} {report.duration:.0f} s] {report.nodeid}\n")
        sys.stderr.flush()


def pytest_sessionfinish(session, exitstatus):
    """Ranks the tests killed could not remove their call-lane socket
    directories (a live rank removes those of dead ones when its lane starts):
    remove what is left of them."""
    import tempfile

    try:
        from sglang.srt.ray.rdt.engine.local_lane import remove_dead_lanes
    except Exception:  # the fork is not installed: nothing can have made one
        return
    for base in {tempfile.gettempdir(), "/tmp"}:
        remove_dead_lanes(base)
