"""``make demo``: RDT weight sync end to end on CPU, nothing downloaded, nothing left running.

1. starts a private Ray head on loopback (own port, temp dir and auth token);
2. builds a tiny random Llama + tokenizer locally (``test/srt/ray/tiny_model.py``);
3. launches ``python -m sglang.launch_server --backend ray --enable-rdt-weight-sync``;
4. runs a trainer in *another* Ray job (``scripts/demo_trainer.py``) that trains
   the model a little and pushes its weights into the running engine three
   times with ``WeightSyncClient``, showing a generation before and after each
   sync with its ``weight_version``, and each sync's bytes, seconds and GB/s;
5. stops the server and the Ray head (by pid: never ``ray stop``, which would
   stop every cluster on the host) and checks that none of it is still running.

    .venv/bin/python scripts/demo.py [--keep-logs]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import requests

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "test" / "srt" / "ray"
sys.path.insert(0, str(TESTS))
# The process plumbing the test suite uses too: Ray head, health wait, stop by pid.
from ray_harness import (  # noqa: E402
    CPU_SERVER_ARGS,
    RayHead,
    free_port,
    processes_with,
    wait_healthy,
)
# Keep the demo's output to the story: no progress bars or import warnings
# from the libraries (the server's own log goes to a file).
QUIET_ENV = {
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "TQDM_DISABLE": "1",
    "PYTHONWARNINGS": "ignore",
}
os.environ.update(QUIET_ENV)

NAMESPACE = "rdt-demo"
SERVER_TIMEOUT_S = 420
TRAINER_TIMEOUT_S = 300
T0 = time.monotonic()
TOTAL_STEPS = 5


def say(text: str = "") -> None:
    print(text, flush=True)


def step(n: int, text: str) -> None:
    say(f"[{n}/{TOTAL_STEPS}] {text}  (t+{time.monotonic() - T0:.0f} s)")


class Demo:
    def __init__(self, keep_logs: bool):
        self.keep_logs = keep_logs
        self.work = Path(tempfile.mkdtemp(prefix="rdt_demo_"))
        self.head: Optional[RayHead] = None
        self.port = free_port()
        self.server: Optional[subprocess.Popen] = None
        self.trainer: Optional[subprocess.Popen] = None
        self.server_log = self.work / "server.log"
        self.go_file = self.work / "engine-ready"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}

    # ------------------------------------------------------------------ #
    def start_ray_head(self) -> None:
        self.head = RayHead.launch(num_cpus=4, namespace=NAMESPACE)
        step(1, f"starting a private Ray head at {self.head.address} (temp dir {self.head.temp_dir})")
        # Ray 2.60 heads use token auth; every process that joins needs it.
        self.env.update({k: v for k, v in self.head.env.items() if k != "RAY_ADDRESS"})

    def wait_ray_head(self) -> None:
        self.head.wait(timeout=120)
        say(f"      Ray head up (t+{time.monotonic() - T0:.0f} s)")

    def build_model(self) -> Path:
        step(2, "building a tiny random Llama and its tokenizer locally (nothing downloaded)")
        import transformers

        from tiny_model import build_tiny_model

        transformers.utils.logging.disable_progress_bar()
        # The tokenizer trainer reports progress from native code, on the fds.
        sys.stdout.flush()
        saved = [os.dup(1), os.dup(2)]
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            return build_tiny_model(self.work / "tiny-llama")
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in (*saved, devnull):
                os.close(fd)

    def start_server(self, model: Path) -> None:
        args = [
            sys.executable, "-m", "sglang.launch_server", "--model-path", str(model),
            "--port", str(self.port), "--backend", "ray", "--enable-rdt-weight-sync",
            "--ray-namespace", NAMESPACE, "--engine-info-bootstrap-port", str(free_port()),
            *CPU_SERVER_ARGS,
        ]
        step(3, "launching the engine: python -m sglang.launch_server --backend ray "
                f"--enable-rdt-weight-sync --ray-namespace {NAMESPACE} --port {self.port} ...")
        with open(self.server_log, "wb") as log:
            self.server = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT,
                env={**self.env, "RAY_ADDRESS": self.head.address}, start_new_session=True,
            )
        self.start_trainer(model)
        tty = sys.stdout.isatty()
        notes = {"last": 0.0}

        def progress(waited: float) -> None:
            if tty:
                print(f"\r      waiting for /health ... {waited:.0f} s", end="", flush=True)
            elif waited - notes["last"] >= 10:
                say(f"      waiting for /health ... {waited:.0f} s")
                notes["last"] = waited

        try:
            waited = wait_healthy(
                self.server, f"http://127.0.0.1:{self.port}", SERVER_TIMEOUT_S,
                log=self.tail, on_wait=progress,
            )
        finally:
            if tty:
                print()
        say(f"      engine healthy after {waited:.0f} s: "
            f"http://127.0.0.1:{self.port} (log: {self.server_log})")

    def start_trainer(self, model: Path) -> None:
        """Start the trainer now: it imports torch, sglang and transformers while
        the engine starts, then waits for the go file (see :meth:`run_trainer`)."""
        cmd = [
            sys.executable, str(REPO / "scripts" / "demo_trainer.py"),
            "--address", self.head.address, "--namespace", NAMESPACE,
            "--port", str(self.port), "--model", str(model), "--syncs", "3",
            "--go-file", str(self.go_file),
        ]
        self.trainer = subprocess.Popen(cmd, env=self.env)

    def run_trainer(self) -> None:
        step(4, "running the trainer in another Ray job: 3 weight syncs with WeightSyncClient")
        self.go_file.touch()
        try:
            rc = self.trainer.wait(timeout=TRAINER_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"the trainer did not finish within {TRAINER_TIMEOUT_S} s")
        if rc != 0:
            raise RuntimeError(f"the trainer failed (exit {rc}); server log tail:\n{self.tail()}")
        status = requests.get(f"http://127.0.0.1:{self.port}/weight_sync/status", timeout=30).json()
        say(f"      engine status: weight_version={status.get('weight_version')}, "
            f"updates={status.get('updates')}, failed={status.get('failed_updates')}, "
            f"weights_consistent={status.get('weights_consistent')}")

    def tail(self, n: int = 4000) -> str:
        try:
            return self.server_log.read_text(errors="replace")[-n:]
        except OSError:
            return "(no log)"

    # ------------------------------------------------------------------ #
    def shutdown(self, keep_logs: bool = False) -> bool:
        step(5, "shutting down: trainer, engine (SIGTERM), Ray head (by pid)")
        if self.trainer is not None and self.trainer.poll() is None:
            self.trainer.kill()
            self.trainer.wait(timeout=30)
        if self.server is not None and self.server.poll() is None:
            self.server.send_signal(signal.SIGTERM)
            try:
                self.server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.server.pid, signal.SIGKILL)
                self.server.wait(timeout=30)
        if self.server is not None:
            # Anything the server started in its own session (tokenizer, ...).
            try:
                os.killpg(self.server.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        left = []
        if self.head is not None:
            self.head.stop()
            left += self.head.processes()
        if self.server is not None:
            left += processes_with(f"--port {self.port}")
        if self.keep_logs or keep_logs:
            say(f"      logs kept in {self.work}")
        else:
            shutil.rmtree(self.work, ignore_errors=True)
        if left:
            say(f"      still running: {[(p.pid, ' '.join(p.cmdline())[:80]) for p in left]}")
            return False
        where = f"Ray head {self.head.address}, " if self.head else ""
        say(f"      nothing left running ({where}engine port {self.port}).")
        return True


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--keep-logs", action="store_true", help="keep the server log and model")
    args = p.parse_args()

    def on_term(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    say("RDT weight sync demo: a trainer job pushes weights into a running SGLang engine "
        "over Ray Direct Transport (same-host fast path, NIXL otherwise), on CPU.")
    demo = Demo(args.keep_logs)
    ok = False
    try:
        demo.start_ray_head()
        model = demo.build_model()  # while the head starts
        demo.wait_ray_head()
        demo.start_server(model)  # returns once /health answers; the trainer
        demo.run_trainer()  # was started meanwhile (see start_trainer)
        ok = True
    except BaseException as e:  # report, then clean up whatever started
        say(f"\nDEMO FAILED: {type(e).__name__}: {e}")
    finally:
        clean = demo.shutdown(keep_logs=not ok)  # a failed run keeps its server log
    total = time.monotonic() - T0
    say(f"\n{'demo finished' if ok and clean else 'demo FAILED'} in {total:.0f} s")
    return 0 if ok and clean else 1


if __name__ == "__main__":
    sys.exit(main())
