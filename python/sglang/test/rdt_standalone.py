"""RDT weight sync's rank core and its actor API around a plain PyTorch model,
without sglang's scheduler: test and benchmark support.

:class:`ModelPort` is a ``sglang.srt.ray.rdt.engine.scheduler_port.SchedulerPort``
over an ``nn.Module`` with its own pause/session flags, and
:class:`ServingLoop` a thread that serves the safe-point queue between
"iterations" as sglang's event loop does: the product's ``RankWeightSync``
runs the SchedulerActor's pull path over them, and :class:`StandaloneRank`
has the SchedulerActor's weight-sync API (``RankActorApi``): the rank of the
GPU benchmark (``benchmark/rdt_weight_sync``) and of the tests.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional

import torch

from sglang.srt.managers.scheduler_safe_point import IDLE_WAIT_S, SafePointQueue
from sglang.srt.ray.rdt.engine.actor_mixin import RankActorApi
from sglang.srt.ray.rdt.engine.rank_sync import RankWeightSync


class ModelPort:
    """A model that serves nothing: pausing and the session are flags; the
    update's end calls ``post_load`` (if given)."""

    def __init__(self, model: torch.nn.Module, post_load: Optional[Callable[[], None]] = None,
                 lora_layout: Optional[Callable[[dict], dict]] = None):
        self.model = model
        self.post_load = post_load
        self._lora_layout = lora_layout  # config -> {PEFT key: shape}: adapters this "model" takes
        self.lora_served: dict = {}  # adapter name -> the bytes it serves (its slot)
        self.lora_apply_seconds = 0.0  # the last lora_apply (a benchmark's breakdown)
        self.is_paused = False
        self.is_session_open = False
        self.version: Optional[str] = None
        self.flushes = 0
        self.sync: Optional[RankWeightSync] = None  # told when the session ends

    def named_parameters(self):
        return self.model.named_parameters()

    def session_open(self) -> bool:
        return self.is_session_open

    def paused(self) -> bool:
        return self.is_paused

    def idle(self) -> bool:
        return True

    def begin_session(self) -> None:
        self.is_session_open = True
        if self.sync is not None:
            self.sync.on_weight_update_begin()

    def end_session(self, abort: Optional[str] = None) -> Optional[str]:
        self.is_session_open = False
        self.run_post_load()
        return self.sync.on_weight_update_end(abort) if self.sync is not None else None

    def run_post_load(self) -> None:
        if self.post_load is not None:
            self.post_load()

    def flush_cache(self) -> bool:
        self.flushes += 1
        return True

    def record_weight_version(self, version: str) -> None:
        self.version = version

    def weight_version(self) -> Optional[str]:
        return self.version

    def lora_layout(self, config: dict):
        if self._lora_layout is None:
            raise RuntimeError("this model takes no LoRA adapters")
        param = next(iter(self.model.parameters()))
        return self._lora_layout(config), param.dtype, param.device

    def lora_apply(self, stash) -> None:
        # The committed tensors copied into the adapter's slot on the device in one batched copy, as sglang's LoRA
        # manager rewrites a resident adapter's memory-pool slot from them (``keep_device``: no host copy; the
        # slot's device-to-device copies batched)
        t0 = time.perf_counter()
        slot = self.lora_served.get(stash.name)
        committed = stash.committed
        if slot is None or {k: t.shape for k, t in slot.items()} != {k: t.shape for k, t in committed.items()}:
            slot = self.lora_served[stash.name] = {k: torch.empty_like(t) for k, t in committed.items()}
        torch._foreach_copy_([slot[key] for key in committed], list(committed.values()), non_blocking=True)
        self.lora_apply_seconds = time.perf_counter() - t0


class ServingLoop:
    """A thread that runs queued safe-point tasks between iterations (and
    wakes at once when one is queued, as sglang's idle wait does: an idle
    iteration costs no CPU and holds no GIL that a caller's thread needs)."""

    def __init__(self, queue: SafePointQueue):
        self.queue = queue
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rank-loop", daemon=True)

    def start(self) -> "ServingLoop":
        self.queue.loop_started()
        self._thread.start()
        return self

    def _run(self) -> None:
        import select

        wake = self.queue.wake_fd()  # readable when a task is queued
        try:
            while not self._stop.is_set():
                self.queue.run_pending(None)
                # An idle iteration: poll for requests; a queued task ends the wait.
                select.select([wake], [], [], IDLE_WAIT_S)
        finally:
            self.queue.loop_stopped()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def standalone_rank(model: torch.nn.Module, port: Optional[ModelPort] = None,
                    **kwargs) -> RankWeightSync:
    """A :class:`RankWeightSync` over ``model`` (or ``port``) with its loop
    running (``.safe_point`` is the queue, ``.port`` the :class:`ModelPort`)."""
    queue = SafePointQueue()
    port = port or ModelPort(model)
    sync = RankWeightSync(port, queue, **kwargs)
    port.sync = sync
    sync.loop = ServingLoop(queue).start()
    return sync


class StandaloneRank(RankActorApi):
    """A rollout rank without sglang: a plain model behind the rank core and
    the SchedulerActor's weight-sync API. Make it a Ray actor with
    ``ray.remote(enable_tensor_transport=True, max_concurrency=8)(StandaloneRank)``.

    Args:
        model: the model, or a function that builds it (in the actor).
        device: its device (``"cuda:0"``, ``"cpu"``); the model is moved there.
        paused: start with generation paused (pulls are accepted; the
            caller ends each update with ``finalize_weight_update``).
        rank: the rank's label in log lines.
        post_load: called at each update's end, as sglang's post-load processing.
        port: the scheduler port to use instead of a :class:`ModelPort` of
            ``model`` (a test's port that is slow or refuses, say).
    """

    def __init__(self, model, *, device: str = "cpu", paused: bool = True, rank: str = "standalone",
                 pull_timeout_s: float = 60.0, post_load: Optional[Callable[[], None]] = None,
                 port: Optional[ModelPort] = None):
        from sglang.srt.ray.rdt.transport import sglang_ipc

        dev = torch.device(device)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        if not isinstance(model, torch.nn.Module):
            model = model()
        self.model = model.to(dev)
        self._rdt_sync = standalone_rank(
            self.model, rank=rank, device=dev if dev.type == "cuda" else None,
            pull_timeout_s=pull_timeout_s, transports=["NIXL", sglang_ipc.register()],
            port=port or ModelPort(self.model, post_load))
        self._rdt_sync.port.is_paused = paused

    def set_paused(self, paused: bool) -> bool:
        """Pause or continue "generation" (continuing ends an update made under the pause)."""
        port = self._rdt_sync.port
        port.is_paused = paused
        if not paused:
            self._rdt_sync.on_scheduler(self._rdt_sync.on_generation_continued)
        return paused

    def get_parallelism_config(self):
        return {"rank": 0, "tp_rank": 0, "tp_size": 1, "pp_rank": 0, "pp_size": 1,
                "dp_rank": 0, "dp_size": 1, "device": "cuda" if self._rdt_sync.device else "cpu"}
