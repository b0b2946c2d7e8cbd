"""This process's NIXL agent, with the thread it starts that spins at idle priority (rdt/transport/nixl_threads.py).

In real Ray actors: :func:`start_nixl_agent` builds the agent, puts exactly
the new thread(s) that poll without sleeping at ``SCHED_IDLE`` (and no other
thread of the process), does nothing the second time, and NIXL still
registers memory and moves bytes afterwards.
"""

from __future__ import annotations

import os

import pytest
import torch


def _probe_class(ray):
    """A plain actor that reports on its own threads (defined here so that
    it is pickled by value: no test module is imported in the worker)."""

    @ray.remote(num_cpus=0, enable_tensor_transport=True)
    class NixlProcess:
        @staticmethod
        def threads():
            """{tid: (scheduling policy, state, name)} of every thread here."""
            out = {}
            for name in os.listdir("/proc/self/task"):
                tid = int(name)
                try:
                    policy = os.sched_getscheduler(tid)
                    with open(f"/proc/self/task/{tid}/stat", "rb") as f:
                        stat = f.read()
                    with open(f"/proc/self/task/{tid}/comm") as f:
                        comm = f.read().strip()
                except OSError:  # the thread ended meanwhile
                    continue
                state = stat[stat.rindex(b")") + 2:].split()[0].decode()
                out[tid] = (policy, state, comm)
            return out

        def start(self):
            from sglang.srt.ray.rdt import start_nixl_agent

            before = self.threads()
            n = start_nixl_agent()
            return before, n, self.threads()

        def states(self, tids, samples):
            """Each thread's state in ``samples`` looks (R: running or
            runnable; S: sleeping), a millisecond apart."""
            import time

            seen = {tid: [] for tid in tids}
            for _ in range(samples):
                for tid in tids:
                    try:
                        with open(f"/proc/self/task/{tid}/stat", "rb") as f:
                            stat = f.read()
                    except OSError:
                        seen[tid].append("gone")
                        continue
                    seen[tid].append(stat[stat.rindex(b")") + 2:].split()[0].decode())
                time.sleep(0.001)
            return seen

        def register(self):
            from ray.experimental import deregister_nixl_memory, register_nixl_memory

            t = torch.arange(1024, dtype=torch.float32)
            register_nixl_memory(t)
            deregister_nixl_memory(t)
            return True

        def fetch(self, refs):
            import ray as ray_mod

            return ray_mod.get(refs[0], timeout=120)

    return NixlProcess


@pytest.fixture(scope="module")
def nixl_process(ray_client):
    ray = ray_client
    actor = _probe_class(ray).remote()
    before, idled, after = ray.get(actor.start.remote(), timeout=300)
    yield ray, actor, before, idled, after
    ray.kill(actor)


def test_start_nixl_agent_idles_exactly_the_spinning_threads_it_started(nixl_process):
    ray, actor, before, idled, after = nixl_process
    new = set(after) - set(before)
    at_idle = {tid for tid, (policy, _, _) in after.items() if policy == os.SCHED_IDLE}
    assert new, "building the NIXL agent started no thread"
    # At least one of the agent's threads polls without sleeping; those and
    # only those were put at idle priority.
    seen = ray.get(actor.states.remote(sorted(new), 200), timeout=120)
    started = {tid: (after[tid], "".join(seen[tid][:40])) for tid in sorted(new)}
    assert idled >= 1 and len(at_idle) == idled, (idled, started)
    assert at_idle <= new, "a thread that was there before the agent changed policy"
    assert all(after[tid][0] == policy for tid, (policy, _, _) in before.items() if tid in after)
    # The idled thread(s) never sleep; the agent's other threads do.
    for tid in at_idle:
        assert set(seen[tid]) == {"R"}, (tid, after[tid], seen[tid])
    for tid in new - at_idle:
        assert "S" in seen[tid] or "gone" in seen[tid], (tid, after[tid], seen[tid][:20])


def test_start_nixl_agent_a_second_time_changes_nothing(nixl_process):
    ray, actor, _, idled, after = nixl_process
    before2, again, after2 = ray.get(actor.start.remote(), timeout=120)
    assert again == idled
    assert set(after2) == set(before2)  # no new thread
    assert {t: p for t, (p, _, _) in after2.items()} == {t: p for t, (p, _, _) in before2.items()}
    assert {t for t, (p, _, _) in after2.items() if p == os.SCHED_IDLE} == \
        {t for t, (p, _, _) in after.items() if p == os.SCHED_IDLE}


def test_nixl_registers_memory_and_moves_bytes_with_its_threads_idle(nixl_process):
    from rdt_actors import ToyTrainer

    ray, actor, _, _, _ = nixl_process
    assert ray.get(actor.register.remote(), timeout=120) is True
    trainer = ToyTrainer.remote()  # puts over NIXL, its own agent started the same way
    try:
        sent = [torch.arange(4096, dtype=torch.float32), torch.full((7,), 3.0, dtype=torch.bfloat16)]
        refs = ray.get(trainer.put.remote(sent), timeout=120)
        got = ray.get(actor.fetch.remote(refs), timeout=180)
        assert len(got) == 2 and all(torch.equal(g, s) for g, s in zip(got, sent))
    finally:
        ray.kill(trainer)
