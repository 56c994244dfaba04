"""The root of kvhandoff's error tree, and the transport's own errors.

The root lives here because `transport` is the bottom layer: `pipelines` and `service` extend this
tree, and the service maps it to HTTP responses in one place. Errors carry structured fields (not
only a message) so that the HTTP layer can name the field, layer, group or kind without parsing.
"""

from __future__ import annotations


class KVHandoffError(Exception):
    """Base of every error kvhandoff raises on purpose."""

    #: A short stable machine-readable code, used as the problem+json `type` suffix.
    code: str = "kvhandoff_error"


class TransportError(KVHandoffError):
    """A transfer or registration failed in the transport; carries the engine's return code."""

    code = "transport_error"

    def __init__(self, message: str, *, rc: int | None = None, peer: str | None = None) -> None:
        details = []
        if peer is not None:
            details.append(f"peer={peer}")
        if rc is not None:
            details.append(f"rc={rc}")
        super().__init__(f"{message} ({', '.join(details)})" if details else message)
        self.rc = rc
        self.peer = peer


class TransportTimeout(TransportError):
    """A transfer did not finish within the configured transfer timeout."""

    code = "transport_timeout"
