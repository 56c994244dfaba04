"""The root of kvhandoff's error tree, and the transport's own errors.

The root lives here because `transport` is the bottom layer: `pipelines` and `service` extend this
tree, and the service maps it to HTTP responses in exactly one place. Every error carries a stable
`code` and a `context` dict of structured facts (`field`, `layer_id`, `group`, `kind`, `pp_rank`,
`peer`, `rc`, ...) so the HTTP layer can name them in a problem+json body without parsing messages.
"""

from __future__ import annotations


class KVHandoffError(Exception):
    """Base of every error kvhandoff raises on purpose."""

    #: Short, stable, machine-readable; used as the problem+json `type` suffix.
    code: str = "kvhandoff_error"

    def __init__(self, message: str, **context: object) -> None:
        super().__init__(message)
        self.message = message
        self.context: dict[str, object] = {k: v for k, v in context.items() if v is not None}


class TransportError(KVHandoffError):
    """A transfer or registration failed in the transport; carries the engine's return code."""

    code = "transport_error"

    def __init__(self, message: str, *, rc: int | None = None, peer: str | None = None) -> None:
        details = []
        if peer is not None:
            details.append(f"peer={peer}")
        if rc is not None:
            details.append(f"rc={rc}")
        super().__init__(
            f"{message} ({', '.join(details)})" if details else message, rc=rc, peer=peer
        )
        self.rc = rc
        self.peer = peer


class EngineCallError(TransportError):
    """The engine call (or its preparation) raised instead of returning a code; `cause` is that
    exception (also `__cause__`), and every batch of the call fails with its own instance."""

    code = "engine_call_error"
    #: None only on an instance rebuilt from a peer's problem+json body (the cause stayed there).
    cause: BaseException | None = None

    def __init__(self, message: str, *, cause: BaseException, peer: str | None = None) -> None:
        super().__init__(message, peer=peer)
        self.cause = cause
        self.__cause__ = cause


class TransportTimeout(TransportError):
    """A transfer did not finish within the configured transfer timeout."""

    code = "transport_timeout"


class PoolError(KVHandoffError):
    """A pool could not be allocated, attached or read (bad spec, size, device or file)."""

    code = "pool_error"
