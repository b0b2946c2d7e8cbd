"""Probe (CUDA): does a stream waiting on another process's IPC event hang when that process dies before the
event completes? On an H100 (driver 580.159.04, torch 2.11) it does: the wait still blocked 40 s after the kill,
where the same wait with the process alive went on after 3.5 s. This is why ranks never wait on the GPU for a
trainer's event (a trainer dying mid-update would hang them); the trainer synchronises its gathers instead.

    python3 benchmark/rdt_weight_sync/ipc_event_probe.py   # prints one line per trial; exits 3 on a hang
"""
import os, signal, sys, time
import torch, torch.multiprocessing as mp

def victim(q, die):
    torch.cuda.set_device(0)
    ev = torch.cuda.Event(interprocess=True); ev.record(); torch.cuda.synchronize()
    torch.cuda._sleep(int(4e9))  # a few seconds of spinning
    ev.record()
    q.put(ev.ipc_handle())
    time.sleep(0.3)
    if die:
        os.kill(os.getpid(), signal.SIGKILL)
    torch.cuda.synchronize(); time.sleep(1)

def trial(die):
    ctx = mp.get_context("spawn"); q = ctx.Queue()
    p = ctx.Process(target=victim, args=(q, die)); p.start()
    h = q.get(timeout=120)
    ev = torch.cuda.Event.from_ipc_handle(0, h)
    s = torch.cuda.current_stream()
    t0 = time.time()
    s.wait_event(ev)
    y = torch.ones(10, device="cuda") * 2
    done = torch.cuda.Event(); done.record()
    while not done.query():
        if time.time() - t0 > 40:
            print(f"die={die}: HANG: the stream still waits 40 s later; victim exitcode {p.exitcode}", flush=True)
            os._exit(3)
        time.sleep(0.005)
    try:
        q_ev = ev.query()
    except Exception as e:
        q_ev = f"{type(e).__name__}: {e}"
    p.join(10)
    print(f"die={die}: the stream went on {time.time() - t0:.2f} s after the wait; imported event query: {q_ev}; "
          f"y ok: {float(y.sum()) == 20.0}; victim exitcode {p.exitcode}", flush=True)

if __name__ == "__main__":
    torch.cuda.set_device(0)
    torch.ones(1, device="cuda")
    trial(False)
    trial(True)
