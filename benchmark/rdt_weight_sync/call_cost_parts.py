"""What ``bench_call_cost.py`` runs against: a miles-shaped trainer actor
(one registered bucket, views put over NIXL), a CPU server of its own (a
private Ray head, the test suite's tiny Llama) and the server's rank actor.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import requests

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "test" / "srt" / "ray"


# --------------------------------------------------------------------------- #
# The trainer: miles' shape (registered bucket, views put over NIXL)
# --------------------------------------------------------------------------- #
def make_trainer(ray):
    @ray.remote(num_cpus=0, max_concurrency=2)
    class CallCostTrainer:
        def __init__(self, shapes, dtypes, transport="nixl"):
            import torch
            from ray.experimental import register_nixl_memory

            from sglang.srt.ray.rdt import start_nixl_agent

            self.transport = transport
            if transport == "SGLANG_IPC":
                from sglang.srt.ray.rdt.transport import sglang_ipc

                sglang_ipc.register()
            # Before anything builds this process's NIXL agent: its progress
            # thread, which polls without sleeping, then runs at idle priority.
            self.idle_nixl_threads = start_nixl_agent()
            dtypes = [getattr(torch, d) for d in dtypes]
            nbytes = sum(math.prod(s) * torch.empty(0, dtype=d).element_size() + 64
                         for s, d in zip(shapes, dtypes))
            self.bucket = torch.zeros(nbytes, dtype=torch.uint8)
            register_nixl_memory(self.bucket)
            self.views, off = [], 0
            for s, d in zip(shapes, dtypes):
                size = torch.empty(0, dtype=d).element_size()
                off = -(-off // 64) * 64
                n = math.prod(s) * size
                v = self.bucket[off: off + n].view(d).view(s)
                v.fill_(1)
                self.views.append(v)
                off += n
            self.refs = []

        def put(self):
            ref = ray.put(self.views, _tensor_transport=self.transport)
            self.refs = [ref]  # the previous call's ref is dropped
            return [ref]

        def calls(self, rank, names, n):
            """``n`` rounds of (no-op, status, put, pull) made from here, as
            miles' trainer makes them: the caller owns the ref it sends, and
            calls right after its put (what the put leaves running in this
            process — Ray's bookkeeping of the new object — is then the
            pull's to pay, not the no-op's)."""
            import time

            clock, rows = time.perf_counter, []
            for _ in range(n):
                t0 = clock()
                ray.get(rank.__ray_ready__.remote(), timeout=60)
                t1 = clock()
                ray.get(rank.get_weight_sync_status.remote(), timeout=60)
                t1b = clock()
                refs = self.put()
                t2 = clock()
                out = ray.get(rank.pull_weights.remote(refs, names), timeout=120)
                t3 = clock()
                rows.append((t0, t1, t1b, t2, t3, out))
            return rows

    return CallCostTrainer


# --------------------------------------------------------------------------- #
# A server of our own (no --url)
# --------------------------------------------------------------------------- #
class OwnServer:
    def __init__(self, extra_args: List[str], log=print):
        sys.path.insert(0, str(TESTS))
        from ray_harness import RayHead  # the suite's and the demo's plumbing

        self.log = log
        self.work = Path(tempfile.mkdtemp(prefix="call_cost_"))
        self.head = RayHead.launch(namespace="call-cost")
        self.proc: Optional[subprocess.Popen] = None
        self.extra_args = extra_args

    def start(self, timeout: float = 480) -> str:
        from ray_harness import CPU_SERVER_ARGS, free_port, wait_healthy
        from tiny_model import build_tiny_model

        model = build_tiny_model(self.work / "tiny-llama")
        self.head.wait()
        os.environ.update(self.head.env)
        self.port = free_port()
        args = [
            sys.executable, "-m", "sglang.launch_server", "--model-path", str(model),
            "--port", str(self.port), *CPU_SERVER_ARGS,
            "--backend", "ray", "--enable-rdt-weight-sync",
            "--ray-namespace", self.head.namespace,
            "--engine-info-bootstrap-port", str(free_port()), *self.extra_args,
        ]
        self.log_path = self.work / "server.log"
        env = {**os.environ, **self.head.env}
        with open(self.log_path, "wb") as f:
            self.proc = subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        url = f"http://127.0.0.1:{self.port}"
        t0 = time.monotonic()
        wait_healthy(self.proc, url, timeout, log=lambda: self.log_path.read_text(errors="replace"))
        self.log(f"server up in {time.monotonic() - t0:.0f} s ({url})")
        return url

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        self.head.stop()
        shutil.rmtree(self.work, ignore_errors=True)


# --------------------------------------------------------------------------- #
def find_rank(ray, port: int, namespace: Optional[str]):
    named = [
        e for e in ray.util.list_named_actors(all_namespaces=True)
        if e["name"].startswith("sglang_scheduler_node") and f"_port{port}_" in e["name"]
        and (namespace is None or e["namespace"] == namespace)
    ]
    if not named:
        raise SystemExit(f"no SchedulerActor of the server on port {port} in this cluster")
    e = sorted(named, key=lambda e: e["name"])[0]
    return ray.get_actor(e["name"], namespace=e["namespace"]), e["name"]


def post(url: str, path: str, body=None) -> Dict[str, Any]:
    r = requests.post(f"{url}{path}", json=body or {}, timeout=120)
    r.raise_for_status()
    return r.json() if r.content else {}
