"""The one admission path of a decode create, whichever door it comes through.

`Admission` is a component of the decode's runtime, built by its assembly
(`kvhandoff.service.runtime.roles.build_decode`) over the pipeline; the records are given to it once
they are open. `Admission.create(request)` is what `POST /v1/handoffs`
(`kvhandoff.service.api.handoffs`) and the embedded `expect_handoff` (`kvhandoff.service.embedded`)
both reach, after each decoded its request into a `HandoffRequest` (the body types' own constraints:
ids, non-negative integers). It runs every check the body types cannot express, in this order, each
refusing before anything changes:

1. peer URL syntax (`prefill[i]`, then kept in canonical form), page and slot bounds
   (`dst_pages[i]`, `dst_slot`), the size of `metadata` (`handoff.max_metadata_bytes`):
   InvalidInput, 422;
2. a state-only handoff (no `dst_pages`) for a model without state: InvalidInput, 422;
3. records that cannot be written: NotReady, 503 — a handoff accepted without its record would
   be neither answered for nor fenced after a crash;
4. a `callback_url` the service may not call (no `webhooks.callback_secret`, records off, or a
   refused target): ConflictError 409 / InvalidInput 422;

then creates the handoff in the pipeline. A create whose own record failed to write is aborted
(its pages released once no write can land) and refused with 503: only what is recorded is
accepted.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from kvhandoff.pipelines.decode import DecodePipeline
from kvhandoff.pipelines.decode.views import HandoffRequest, HandoffView
from kvhandoff.pipelines.errors import ConflictError, InvalidInput
from kvhandoff.service.http.problems import NotReady
from kvhandoff.service.runtime import inputs
from kvhandoff.service.runtime.persistence import Persistence

#: The reason an unrecorded create is aborted with.
UNRECORDED = "its record could not be written"


@dataclass
class Admission:
    """Admits a decode's creates into `pipeline` (see the module docstring)."""

    pipeline: DecodePipeline
    #: `handoff.max_metadata_bytes`.
    max_metadata_bytes: int
    #: The records and webhooks once open; None while records are off (`records.persist`).
    persistence: Persistence | None = None

    def check(self, request: HandoffRequest) -> HandoffRequest:
        """Steps 1 to 3 (no await): what a create is refused for before anything is looked
        up. Returns the request with its prefill URLs in canonical form (a trailing "/" once
        made every arrival of a stage not count: URLs are compared in that form)."""
        request = msgspec.structs.replace(
            request, prefill=inputs.peer_urls(request.prefill, "prefill")
        )
        inputs.pages(request.dst_pages, "dst_pages")
        inputs.slots(request.dst_slot, request.dst_slots, request.dst_aux, "dst")
        inputs.metadata(request.metadata, self.max_metadata_bytes, "metadata")
        layout = self.pipeline.layout
        if not request.dst_pages and not layout.state and not layout.aux:
            # Empty pages are a state-only handoff (README); without state there is nothing to
            # move.
            raise InvalidInput(
                "dst_pages is empty and the model has no state or aux rows to move",
                field="dst_pages",
            )
        self._records_writable()
        return request

    async def create(self, request: HandoffRequest) -> tuple[HandoffView, bool]:
        """Admit and create a handoff: (view, created), as `DecodePipeline.create` answers."""
        request = self.check(request)
        persistence = self.persistence
        if request.callback_url is not None:
            if persistence is None:
                raise ConflictError(
                    "records and webhooks are off on this service (records.persist = false)",
                    field="records.persist",
                )
            await persistence.check_callback(request.callback_url)
        view, created = await self.pipeline.create(request)
        if created and persistence is not None:
            await persistence.db.committed()  # the group commit of this turn of the loop
        if created and persistence is not None and persistence.broken is not None:
            # Its `handoff.created` was published, and the record of it (or one just before)
            # did not reach the disk: undo it rather than promise what a crash would forget.
            await self.pipeline.abort(view.id, UNRECORDED)
            self._records_writable()
        return view, created

    def _records_writable(self) -> None:
        persistence = self.persistence
        if persistence is not None and persistence.broken is not None:
            # Refuse new work once a write failed (readiness says the same) until the service
            # is restarted.
            raise NotReady(
                f"handoff records cannot be written ({persistence.broken}); use another decode "
                "service until this one is restarted",
                not_ready=["records"],
            )
