"""Domain errors of `pipelines`, extending the tree rooted in `kvhandoff.transport.errors`.

Nothing here knows about HTTP; `service` maps each class to a status code in one place.
"""

from __future__ import annotations

from kvhandoff.transport.errors import KVHandoffError, TransportError, TransportTimeout

__all__ = [
    "CapacityExceeded",
    "ConflictError",
    "DeadlineExceeded",
    "DigestMismatch",
    "EngineAborted",
    "InternalError",
    "InvalidInput",
    "KVHandoffError",
    "LayoutError",
    "NotFoundError",
    "PairingError",
    "PeerUnreachable",
    "PlanError",
    "TransportError",
    "TransportTimeout",
]


class InvalidInput(KVHandoffError):
    """A caller supplied a value that can never be valid; `context['field']` names it."""

    code = "invalid_input"


class LayoutError(InvalidInput):
    """A layout is inconsistent in itself (e.g. a buffer count not a multiple of the layers)."""

    code = "layout_error"


class PlanError(InvalidInput):
    """Page or slot indices of one request cannot be planned (out of range, duplicated, unequal)."""

    code = "plan_error"


class PairingError(KVHandoffError):
    """Two layouts cannot be paired; `problems` lists every reason, the message names the first."""

    code = "pairing_error"

    def __init__(self, problems: list[object]) -> None:
        first = problems[0] if problems else None
        message = getattr(first, "message", "layouts cannot be paired")
        extra = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
        context = {
            key: getattr(first, key, None)
            for key in ("layer_id", "group", "kind", "aux", "pp_rank")
        }
        super().__init__(f"{message}{extra}", **context)
        self.problems = problems


class ConflictError(KVHandoffError):
    """The request conflicts with current state (a leased page, an id reused with another body)."""

    code = "conflict"


class DigestMismatch(ConflictError):
    """Landed bytes did not hash to the digest their sender computed: a stale, misdirected or
    corrupted write reached the window. Nothing of them was committed."""

    code = "digest_mismatch"


class EngineAborted(ConflictError):
    """The prefill engine gave up on the request (a client abort): its stages will not send."""

    code = "engine_aborted"


class CapacityExceeded(KVHandoffError):
    """Too much live work to accept more now; retrying later can succeed."""

    code = "capacity_exceeded"


class NotFoundError(KVHandoffError):
    """The named object does not exist."""

    code = "not_found"


class DeadlineExceeded(KVHandoffError):
    """A handoff did not finish before its deadline."""

    code = "deadline_exceeded"


class InternalError(KVHandoffError):
    """A bug: something that should not happen did. Logged with a traceback where caught."""

    code = "internal_error"


class PeerUnreachable(KVHandoffError):
    """A peer service could not be reached or went silent; `context['peer']` names it."""

    code = "peer_unreachable"
