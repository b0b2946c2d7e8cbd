"""Every exception a caller can catch (``WeightSyncError`` is the base), and the helpers of their messages."""

from __future__ import annotations

import difflib
from typing import Any, Iterable, Optional, Sequence, Tuple


class WeightSyncError(ValueError):
    """A pull that was rejected or failed; the message says what and what to do."""


class WeightsInconsistentError(WeightSyncError):
    """A transfer broke after bytes may have landed: weights are a mix now."""


class WeightUpdateConflictError(WeightSyncError):
    """Two different writers wrote the same parameter in one update."""


class WeightSyncSessionError(WeightSyncError):
    """The engine's update session could not be opened, ended or aborted."""


class WeightSyncRankError(WeightSyncError):
    """One or more ranks failed; names the first and carries every failure.

    Attributes:
        rank, actor_name: the first failing rank and its SchedulerActor name (or ``None``).
        phase: what the caller was doing (``"register"``).
        cause: the rank's own exception (unwrapped from Ray's ``RayTaskError``).
        failures: ``[(rank, cause), ...]`` for every rank that failed.
        aborted: whether the client aborted the engine's update session.
    """

    def __init__(self, rank: int, actor_name: Optional[str], phase: str,
                 cause: BaseException, failures: Sequence[Tuple[int, BaseException]]):
        self.rank, self.actor_name, self.phase, self.cause = rank, actor_name, phase, cause
        self.failures = list(failures)
        self.aborted = False
        who = f"rank {rank}" + (f" ({actor_name})" if actor_name else "")
        msg = f"{who} failed during {phase}: {describe(cause)}"
        others = [r for r, _ in self.failures if r != rank]
        if others:
            msg += f" [also failed: rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))}]"
        super().__init__(msg)


def unwrap(e: BaseException) -> BaseException:
    """The rank's own exception inside Ray's wrappers, when there is one."""
    cause = getattr(e, "cause", None)
    return cause if isinstance(cause, BaseException) else e


def dtype_name(dtype: Any) -> str:
    """``torch.float32`` / ``"torch.float32"`` / ``"float32"`` -> ``"float32"``."""
    return str(dtype).replace("torch.", "")


def close_names(name: str, candidates: Iterable[str]) -> str:
    """A hint for an unknown parameter ``name`` among ``candidates``."""
    candidates = list(candidates)
    close = difflib.get_close_matches(name, candidates, n=3, cutoff=0.6)
    if close:
        return "did you mean " + ", ".join(repr(c) for c in close) + "?"
    return f"it has {len(candidates)} parameters, e.g. {next(iter(candidates), None)!r}"


def describe(e: BaseException) -> str:
    text = str(e).strip()
    if type(e).__name__ in ("RayActorError", "ActorDiedError", "ActorUnavailableError"):
        first = text.splitlines()[0] if text else ""
        return f"the actor died or is unreachable ({type(e).__name__}: {first})"
    if len(text) > 2000:
        text = text[:2000] + " ..."
    return f"{type(e).__name__}: {text}"
