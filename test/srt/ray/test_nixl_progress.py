"""NIXL's progress thread sleeps between events in every RDT process (rdt/transport/nixl_progress.py)."""

from __future__ import annotations

import pytest


# --------------------------------------------------------------------------- #
# NIXL progress thread: no core spinning for the life of every RDT process
# --------------------------------------------------------------------------- #
_IDLE_AGENT = """
import json, os, resource, sys, time
configure = sys.argv[1] == "configure"
if configure:
    from sglang.srt.ray.rdt.transport.nixl_progress import agent_created, configure_nixl_progress_thread
    delay = configure_nixl_progress_thread()
from ray.experimental.rdt.util import get_tensor_transport_manager
agent = get_tensor_transport_manager("NIXL").get_nixl_agent()  # as Ray's first NIXL use does
if sys.argv[1] == "late":  # configured only after the agent exists: too late, and said so
    from sglang.srt.ray.rdt.transport.nixl_progress import configure_nixl_progress_thread, describe
    print("RESULT " + json.dumps({"late": configure_nixl_progress_thread(),
                                  "again": configure_nixl_progress_thread(),
                                  "describe": describe()}), flush=True)
    sys.exit(0)
time.sleep(1.0)
r0, w0 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
time.sleep(3.0)
r1, w1 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
cpu = (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)
out = {"cores": cpu / (w1 - w0)}
if configure:
    from sglang.srt.ray.rdt.transport.nixl_progress import describe
    out.update(delay=delay, created=agent_created(), again=configure_nixl_progress_thread(),
               describe=describe())
print("RESULT " + json.dumps(out), flush=True)
"""


def _idle_agent(ray_head, mode, **env):
    import json
    import os
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", _IDLE_AGENT, mode], capture_output=True, text=True, timeout=180,
        env={**os.environ, **ray_head.env, **env},
    )
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):]), proc.stderr


def test_nixl_progress_thread_sleeps_between_events(ray_head):
    # The agent as Ray makes it: its UCX progress thread polls with a 0 delay
    # and keeps a core busy while the process does nothing.
    raw, _ = _idle_agent(ray_head, "plain")
    assert raw["cores"] > 0.4, raw
    # Configured first (what the receiver, the sender and the transport do).
    tamed, err = _idle_agent(ray_head, "configure")
    assert tamed["delay"] == 1000 and tamed["created"] is True, tamed
    assert tamed["cores"] < 0.2, (tamed, raw)
    # Asked again once the agent exists with the delay: nothing to warn about.
    assert tamed["again"] == 1000 and "exists already" not in err
    assert tamed["describe"] == "sleeps up to 1000 us between UCX events"
    # Configured only after the agent was made without it: said once, not on every call.
    late, err = _idle_agent(ray_head, "late")
    assert late["late"] == late["again"] == 1000, late
    assert late["describe"] == "busy-polls (NIXL default)"
    assert err.count("exists already; its progress thread keeps polling without a delay") == 1, err[-2000:]
    # 0 keeps NIXL's own setting (documented escape hatch).
    kept, _ = _idle_agent(ray_head, "configure", SGLANG_RDT_NIXL_PROGRESS_DELAY_US="0")
    assert kept["delay"] is None and kept["cores"] > 0.4, kept
    assert kept["describe"] == "busy-polls (NIXL default)"


def test_nixl_progress_delay_setting_is_checked(monkeypatch):
    from sglang.srt.ray.rdt.transport import nixl_progress

    monkeypatch.setenv("SGLANG_RDT_NIXL_PROGRESS_DELAY_US", "soon")
    with pytest.warns(UserWarning, match="SGLANG_RDT_NIXL_PROGRESS_DELAY_US"):
        assert nixl_progress.progress_delay_us() == 1000  # sglang's envs: warn, use the default
    monkeypatch.setenv("SGLANG_RDT_NIXL_PROGRESS_DELAY_US", "-5")
    with pytest.raises(ValueError, match=">= 0, got -5"):
        nixl_progress.progress_delay_us()
    monkeypatch.setenv("SGLANG_RDT_NIXL_PROGRESS_DELAY_US", "2500")
    assert nixl_progress.progress_delay_us() == 2500
