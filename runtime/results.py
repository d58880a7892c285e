"""What a streamed request gets back: a ``Result`` (answered, maybe with a backend error) or a ``Rejected``.

Every request submitted to a session resolves to exactly one of these; nothing is dropped silently.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

# Rejection reasons (``Rejected.reason``).
BUDGET = "budget"        # at admission: the budget cannot be met even alone, by any variant
OVERLOAD = "overload"    # at admission: queue full, or the predicted queueing delay would break the budget
DEADLINE = "deadline"    # at dispatch: admitted, then dropped at its deadline (a budget miss, counted as one)
SHUTDOWN = "shutdown"    # the session closed before the request ran


def describe_array(value: Any) -> str:
    """``float32[2, 4]`` for an array (dtype and shape, not its values); the type name for anything else."""
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is None or dtype is None:
        return type(value).__name__
    return f"{dtype}[{', '.join(map(str, shape))}]"


@dataclass(frozen=True, repr=False)
class Result:
    """An answered request.

    Attributes:
        id: the request id (``submit(..., id=)`` or a per-session counter; ``stream`` uses the input index).
        outputs: numpy arrays keyed by output name, this request's rows only (batch axis kept, padding removed);
            empty when ``error`` is set.
        latency_ms: submit → answer, wall-clock ms (``time.perf_counter``).
        queue_ms: submit → start of the batch that served it, ms.
        batch_size: rows in the batch that served it (1 = ran alone).
        variant: the bundle variant that served it (``"int8"``, …; differs from the session's under cascade).
        budget_ms: the latency budget the request was admitted with.
        error: ``"ExceptionType: message"`` when the backend failed this request's batch, else None.

    ``repr`` is one short line: the outputs as name → dtype[shape], not their values.
    """

    id: Any
    outputs: dict[str, np.ndarray]
    latency_ms: float
    queue_ms: float
    batch_size: int
    variant: str
    budget_ms: float = float("inf")
    error: str | None = None

    @property
    def ok(self) -> bool:
        """True when the backend produced outputs (no error)."""
        return self.error is None

    @property
    def within_budget(self) -> bool:
        """True when answered without error and ``latency_ms <= budget_ms`` (counts toward goodput)."""
        return self.error is None and self.latency_ms <= self.budget_ms

    def __repr__(self) -> str:
        outputs = ", ".join(f"{name!r}: {describe_array(v)}" for name, v in self.outputs.items())
        return (f"Result(id={self.id!r}, variant={self.variant!r}, latency_ms={self.latency_ms:.3f}, "
                f"batch_size={self.batch_size}, outputs={{{outputs}}}, error={self.error!r})")


@dataclass(frozen=True)
class Rejected:
    """A request the session refused or could not run, answered at once (admission) or at dispatch/shutdown.

    Attributes:
        id: the request id.
        reason: ``"budget"``, ``"overload"``, ``"deadline"`` or ``"shutdown"`` (see the module constants).
        detail: one line saying why, with the numbers (predicted vs budget ms, queue depth).
        budget_ms: the request's latency budget.
        latency_ms: submit → rejection, ms (≈ 0 at admission).
    """

    id: Any
    reason: str
    detail: str = ""
    budget_ms: float = float("inf")
    latency_ms: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    ok = False
    within_budget = False

    @property
    def admitted(self) -> bool:
        """True for a request admitted and then dropped at its deadline ("deadline"): a budget miss, not a
        refusal at admission."""
        return self.reason == DEADLINE
