"""Every default of RDT weight sync, engine and trainer sides. Imports nothing, so every module may use it."""

# Ray tensor-transport names a rank pulls refs of (SGLANG_IPC: transport/sglang_ipc.py).
NIXL = "NIXL"
SGLANG_IPC = "SGLANG_IPC"
PULLABLE_TRANSPORTS = (NIXL, SGLANG_IPC)

# A pull's transfer, on the rank (--rdt-pull-timeout's default).
PULL_TIMEOUT_S = 60.0
# How long a call waits for the scheduler loop to reach a safe point.
SAFE_POINT_TIMEOUT_S = 120.0
# How long a pull waits for a /pause_generation that is on its way to the scheduler.
PAUSE_GRACE_S = 1.0

# The engine aborts an update session not ended within this many seconds.
SESSION_LEASE_S = 300.0
# How long opening a session waits for in-flight requests to finish.
SESSION_DRAIN_TIMEOUT_S = 120.0

# Trainer side: bound on every call but pulls (register, layout, session).
CALL_TIMEOUT_S = 120.0
# A pull starts at a safe point up to SAFE_POINT_TIMEOUT_S away: the trainer waits that much (and 30 s) more.
PULL_WAIT_MARGIN_S = SAFE_POINT_TIMEOUT_S + 30.0
# Bucket slot (and group) sizes: one transfer each, two slots in flight (docs/performance.md).
CPU_BUCKET_BYTES = 256 << 20
GPU_BUCKET_BYTES = 1 << 30
# An iterator read in place goes out in groups of bucket_bytes / this.
STREAM_GROUPS_PER_BUCKET = 2


def bucket_bytes_for(device: str) -> int:
    return GPU_BUCKET_BYTES if str(device).startswith("cuda") else CPU_BUCKET_BYTES
