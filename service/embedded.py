"""kvhandoff inside an engine process: the service on its own thread, called directly.

An inference engine (vLLM- or SGLang-like) that embeds kvhandoff instead of running it as a
sidecar builds an `EmbeddedService` over its own KV and state buffers and calls it from its own
threads: `stage_ready` on the prefill role; `expect_handoff`, `get`, `wait` and `abort` on the
decode role. The whole HTTP service still listens (peers and routers reach it there). Each call
runs on the service's event loop and re-raises the pipelines' errors, same classes, in the
caller's thread; none may be made from the service's own thread.

    layout = embedded_layout(config, pp_rank=0)          # what to allocate, in which order
    buffers = {0: [torch.empty(n, dtype=torch.uint8) for n in layout.region_sizes]}
    with EmbeddedService(config, buffers=buffers) as kv:
        kv.stage_ready("req-1", 0, src_pages=[3, 4, 9], src_slot=2)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import operator
import threading
from collections.abc import Callable, Coroutine, Mapping, Sequence
from types import TracebackType
from typing import Any, TypeVar

import msgspec
import numpy as np
import uvloop

from kvhandoff.pipelines.decode import DecodePipeline
from kvhandoff.pipelines.decode.views import HandoffId, HandoffRequest, HandoffView
from kvhandoff.pipelines.errors import InternalError, InvalidInput
from kvhandoff.pipelines.events import Event
from kvhandoff.pipelines.layout import StageLayout
from kvhandoff.pipelines.messages import LayoutInfo
from kvhandoff.pipelines.prefill import PrefillPipeline
from kvhandoff.pipelines.slots import RequestSlots
from kvhandoff.pipelines.urls import ServiceUrl
from kvhandoff.service.config import Config, ConfigError
from kvhandoff.service.http.problems import NotReady, invalid_value
from kvhandoff.service.observability.loop_stalls import LoopStalls
from kvhandoff.service.observability.metrics import METRICS
from kvhandoff.service.runtime.roles import RUNTIME, DecodeRuntime, PrefillRuntime, RuntimeBase
from kvhandoff.service.runtime.stages import Buffers, EngineStage, unplaced_layout
from kvhandoff.service.serve import SHUTDOWN_TIMEOUT_S, Server, serve, service_with

log = logging.getLogger("kvhandoff.embedded")
T = TypeVar("T")


class WrongRole(InvalidInput):
    """A call of one role made on a service of the other role."""

    code = "wrong_role"


def embedded_layout(config: Config, pp_rank: int) -> StageLayout:
    """The (unplaced) layout of stage `pp_rank`: one buffer per entry, KV entries first, then
    state entries, each at least `region_sizes[i]` bytes — what an engine must hand over."""
    for stage in config.stages:
        if stage.pp_rank == pp_rank:
            return unplaced_layout(config, config.model_spec(), stage)
    hosted = sorted(s.pp_rank for s in config.stages)
    raise ConfigError("stages", f"no stage has pp_rank {pp_rank} (configured: {hosted})")


class EmbeddedService:
    """kvhandoff running inside an engine process: its own thread and event loop (uvloop), the
    engine's own buffers, and direct calls instead of HTTP for the engine-facing operations.

    Engine-thread calls wait at most `call_timeout_s` (default: one peer request plus one
    transfer, the longest the service itself lets a create or an abort take) and raise
    TimeoutError past it; `wait` adds its own `timeout_s`.
    """

    def __init__(
        self,
        config: Config,
        *,
        buffers: Buffers | None = None,
        start_timeout_s: float = 60.0,
        call_timeout_s: float | None = None,
    ) -> None:
        self._config = config
        self._buffers = (
            None
            if buffers is None
            else {
                int(rank): b if isinstance(b, EngineStage) else list(b)
                for rank, b in buffers.items()
            }
        )
        self._start_timeout_s = start_timeout_s
        self._call_timeout_s = (
            call_timeout_s
            if call_timeout_s is not None
            else config.peers.request_timeout_s + config.transport.max_call_s + 5.0
        )
        self._lock = threading.Lock()
        self._phase = "new"  # "new" -> "running" -> ("stopping" ->) "stopped"
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._main_task: asyncio.Task[None] | None = None
        self._stopping: asyncio.Event | None = None
        self._server: Server | None = None
        self._started: concurrent.futures.Future[Server] = concurrent.futures.Future()
        #: How long the service's loop could not run (`kvhandoff_embedded_loop_stall_*`).
        self.stalls: LoopStalls | None = None
        self._finished: concurrent.futures.Future[None] = concurrent.futures.Future()

    # ----------------------------------------------------------------- lifecycle

    def start(self) -> EmbeddedService:
        """Start the service thread and return once the app serves; a start-up error (a
        ConfigError for wrong buffers, a port in use, ...) is raised here, nothing left running."""
        with self._lock:
            if self._phase != "new":
                raise RuntimeError(f"an EmbeddedService starts once (this one is {self._phase})")
            if self._buffers is not None:
                _check_buffers(self._config, self._buffers)
            self._phase = "running"
            self._thread = threading.Thread(
                target=self._run_thread,
                name=f"kvhandoff-embedded-{self._config.role}",
                daemon=True,  # never keeps an engine process alive on its own
            )
            self._thread.start()
        outcomes: list[concurrent.futures.Future[Any]] = [self._started, self._finished]
        done, _ = concurrent.futures.wait(
            outcomes,
            timeout=self._start_timeout_s,
            return_when=concurrent.futures.FIRST_COMPLETED,
        )
        if self._started in done:
            self._server = self._started.result()
            return self
        with self._lock:
            self._phase = "stopped"
        if self._finished in done:
            self._thread.join()
            error = self._finished.exception()
            raise error or InternalError("the service thread ended before the app started")
        self._cancel_start()
        raise TimeoutError(f"kvhandoff did not start within {self._start_timeout_s:g} s")

    def stop(self, timeout_s: float | None = None) -> None:
        """Abort live handoffs, unregister the buffers, close the transport, join the thread.

        Returns once no write can land in the engine's buffers any more: every handoff's pages
        are released first (each writer confirmed it stopped, or the bound — the deadline plus
        the longest engine call its prefill declared — passed), so by default it waits as long
        as that takes; past `timeout_s` it raises TimeoutError instead. Idempotent; a no-op on a
        service never started. An error of the shutdown itself is raised here, once.
        """
        with self._lock:
            phase = self._phase
            if phase == "running":
                self._phase = "stopping"  # no new calls; a stop that timed out may be retried
        if phase not in ("running", "stopping"):
            return
        assert self._thread is not None and self._loop is not None and self._stopping is not None
        # A closed loop means the thread has ended on its own: nothing to signal.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._stopping.set)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"kvhandoff did not stop within {timeout_s:g} s; call stop() again")
        with self._lock:
            if self._phase == "stopped":
                return  # another stop() finished first and reported
            self._phase = "stopped"
        error = self._finished.exception()
        if error is not None:
            raise error

    def __enter__(self) -> EmbeddedService:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def url(self) -> str:
        """The service's public URL (the real port when `server.port` is 0)."""
        return self._running_server().url

    def layout(self) -> LayoutInfo:
        """The stages hosted here, placed in the engine's buffers: what `GET /v1/layout` answers."""
        return self._call_sync(lambda runtime: runtime.layout_info())

    def add_listener(self, listener: Callable[[Event], None]) -> None:
        """Call `listener` with every event of this service from now on (both roles), on the
        service's own thread: it must return at once and never call back into this service (an
        engine adapter keeps a snapshot of its handoffs' states with it)."""
        self._call_sync(lambda runtime: runtime.bus.add_listener(listener))

    # ----------------------------------------------------------------- prefill role

    def stage_ready(
        self,
        handoff_id: str,
        pp_rank: int,
        src_pages: Sequence[int] | np.ndarray[Any, Any] | None,
        src_slot: int | None = None,
        layers: Sequence[int] | None = None,
        *,
        decode_url: str | None = None,
        pages_from: int | None = None,
        last_pages: bool | None = None,
        src_slots: Mapping[str, int] | None = None,
        src_aux: int | None = None,
    ) -> None:
        """Stage `pp_rank` finished `layers` (None: all its layers) of this request, or with
        `pages_from` the next range of its pages (`last_pages` on the last, with the slots):
        `src_slot` is the slot of every state component `src_slots` leaves out, `src_aux` the
        request's aux row (the last stage of a layout with aux entries). As
        `POST /v1/handoffs/{id}/stages/{pp_rank}/ready`, with the same errors (InvalidInput and
        PlanError naming the field, NotFoundError, ConflictError). The pages are copied here:
        the engine may reuse its array once this returns. `decode_url` names the decode
        service the id belongs to (ids are unique per decode).
        """
        self._require("prefill", "stage_ready")
        _check_id(handoff_id)
        _check_decode_url(decode_url)
        rank = _non_negative(pp_rank, "pp_rank")
        slots = _request_slots(src_slot, src_slots, src_aux)
        start = None if pages_from is None else _non_negative(pages_from, "pages_from")
        last_pages = _optional_bool(last_pages, "last_pages")
        layer_ids = (
            None
            if layers is None
            else [_non_negative(x, f"layers[{i}]") for i, x in enumerate(layers)]
        )
        pages = None if src_pages is None else np.array(src_pages)  # a copy, never a view

        def ready(runtime: RuntimeBase) -> None:
            _prefill_of(runtime).ready(
                handoff_id,
                rank,
                pages,
                slots,
                layer_ids,
                decode_url=decode_url,
                pages_from=start,
                last_pages=last_pages,
            )

        self._call_sync(ready)

    def abort_prefill(self, handoff_id: str, reason: str, *, decode_url: str | None = None) -> None:
        """The engine gave up on this request: stop sending it (prefill role) and fail it on
        the decode side (`engine_aborted`, naming each stage). Returns once no write of it can
        still land and its source pages are no longer read. `decode_url` as for
        `stage_ready`."""
        self._require("prefill", "abort_prefill")
        _check_id(handoff_id)

        async def stop(runtime: RuntimeBase) -> None:
            await _prefill_of(runtime).give_up(handoff_id, reason, decode_url=decode_url)

        self._call(stop, self._call_timeout_s)

    def withdraw_prefill(self, handoff_id: str, reason: str) -> bool:
        """The engine needs no transfer of this handoff after all (e.g. another of its ranks
        sends it): end it here `aborted` with `reason`, without failing it on a decode. Returns
        False, changing nothing, when a decode already holds it (its destination came): then
        `abort_prefill` is the call, which fails it there too."""
        self._require("prefill", "withdraw_prefill")
        _check_id(handoff_id)

        async def withdraw(runtime: RuntimeBase) -> bool:
            return await _prefill_of(runtime).withdraw(handoff_id, reason)

        return bool(self._call(withdraw, self._call_timeout_s))

    # ----------------------------------------------------------------- decode role

    def expect_handoff(self, request: HandoffRequest) -> HandoffView:
        """Create a handoff into these decode pages, as `POST /v1/handoffs` (idempotent for an
        identical request; ConflictError for another one under the same id).

        A TimeoutError here means the handoff was not created: the time limit is applied on the
        service's loop, where a create cut short leases nothing (it leases only after its last
        wait), and this call waits for that cut to happen."""
        self._require("decode", "expect_handoff")
        checked = _checked_request(request)
        limit_s = self._call_timeout_s

        async def create(runtime: RuntimeBase) -> HandoffView:
            try:
                async with asyncio.timeout(limit_s):
                    # The one admission path, as `POST /v1/handoffs`
                    # (kvhandoff.service.runtime.admission).
                    view, _ = await _decode_runtime(runtime).create(checked)
            except TimeoutError:
                raise TimeoutError(
                    f"handoff {checked.id!r} was not created within {limit_s:g} s"
                ) from None
            return view

        # The loop-side limit decides; the margin only covers handing the answer back.
        return self._call(create, limit_s + 5.0)

    def get(self, handoff_id: str) -> HandoffView:
        self._require("decode", "get")
        return self._call_sync(lambda runtime: _decode_of(runtime).get(handoff_id))

    def wait(self, handoff_id: str, timeout_s: float, *, released: bool = False) -> HandoffView:
        """The handoff once it has an outcome (`state` completed, failed or aborted: what a
        scheduler acts on), or with `released=True` once its pages are free again (`released`:
        what an engine must wait for before it reuses the pages); or as it is after
        `timeout_s`."""
        self._require("decode", "wait")
        if not timeout_s >= 0:
            raise InvalidInput(f"timeout_s = {timeout_s} is not >= 0", field="timeout_s")
        return self._call(
            lambda runtime: _decode_of(runtime).wait(handoff_id, timeout_s, released=released),
            timeout_s + self._call_timeout_s,
        )

    def released(self, handoff_id: str, timeout_s: float) -> bool:
        """Whether the handoff's destination pages and slot are free (no write of it can land
        any more), waiting up to `timeout_s` for it. Reuse pages only after True."""
        return self.wait(handoff_id, timeout_s, released=True).released

    def abort(self, handoff_id: str) -> HandoffView:
        """Abort a handoff; returns once its pages are released (no write of it can still land
        on them). On a failed handoff not yet released, hurries and waits for its release."""
        self._require("decode", "abort")
        return self._call(
            lambda runtime: _decode_of(runtime).abort(handoff_id), self._call_timeout_s
        )

    # ----------------------------------------------------------------- the service thread

    def _run_thread(self) -> None:
        try:
            uvloop.run(self._main())
        # The thread boundary: every outcome, start-up errors included, goes to the caller.
        except BaseException as exc:  # noqa: BLE001
            self._finished.set_exception(exc)
        else:
            self._finished.set_result(None)

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._main_task = asyncio.current_task()
        self._stopping = asyncio.Event()
        # The same service as `kvhandoff serve`, the same role assembly, over the engine's buffers.
        async with serve(self._config, [service_with(self._buffers)]) as server:
            # The engine process runs this loop only when the OS runs the process and the
            # engine's threads let go of the GIL: how long it could not is a metric (and a
            # warning past a second), so a peer's timeout can be told from a dead peer.
            self.stalls = LoopStalls(server.app[METRICS].registry)
            ticker = asyncio.create_task(self.stalls.run(), name="kvhandoff-loop-stalls")
            self._started.set_result(server)
            try:
                # Leaving serve() closes the pipelines: live handoffs are aborted (no write can
                # land in the engine's buffers afterwards), then the buffers are unregistered.
                await self._stopping.wait()
            finally:
                ticker.cancel()
                await asyncio.wait([ticker])

    def _cancel_start(self) -> None:
        """Start-up hangs (e.g. an unreachable Mooncake metadata server): cancel and let go."""
        loop, task, thread = self._loop, self._main_task, self._thread
        if loop is not None and task is not None:
            with contextlib.suppress(RuntimeError):  # closed meanwhile: ending anyway
                loop.call_soon_threadsafe(task.cancel)
        if thread is not None:
            thread.join(SHUTDOWN_TIMEOUT_S)  # a blocking engine call may outlive this (daemon)

    # ----------------------------------------------------------------- calls into the loop

    def _require(self, role: str, call: str) -> None:
        if self._config.role != role:
            raise WrongRole(
                f"{call}() is a {role}-role call; this service is {self._config.role}",
                field="role",
                role=self._config.role,
            )

    def _running_server(self) -> Server:
        if self._phase != "running" or self._server is None:
            raise NotReady(f"the embedded kvhandoff service is not running ({self._phase})")
        return self._server

    def _call(self, make: Callable[[RuntimeBase], Coroutine[Any, Any, T]], timeout_s: float) -> T:
        server = self._running_server()
        loop = self._loop
        assert loop is not None and self._thread is not None
        if threading.get_ident() == self._thread.ident:
            raise RuntimeError("called from the service's own thread: it would wait on itself")
        coro = make(server.app[RUNTIME])
        try:
            future = asyncio.run_coroutine_threadsafe(coro, loop)
        except RuntimeError:  # the loop closed between the check and the call
            coro.close()
            raise NotReady("the embedded kvhandoff service has stopped") from None
        try:
            return future.result(timeout_s)
        except TimeoutError:
            if future.done():  # the call itself raised TimeoutError: pass it on as is
                raise
            future.cancel()
            raise TimeoutError(f"kvhandoff did not answer within {timeout_s:g} s") from None

    def _call_sync(self, fn: Callable[[RuntimeBase], T]) -> T:
        async def run(runtime: RuntimeBase) -> T:
            return fn(runtime)

        return self._call(run, self._call_timeout_s)


# ---------------------------------------------------------------------------------------------
# Helpers


def _prefill_of(runtime: RuntimeBase) -> PrefillPipeline:
    if not isinstance(runtime, PrefillRuntime):  # checked by EmbeddedService._require
        raise WrongRole(f"this service is {runtime.role}", field="role", role=runtime.role)
    return runtime.pipeline


def _decode_runtime(runtime: RuntimeBase) -> DecodeRuntime:
    if not isinstance(runtime, DecodeRuntime):  # checked by EmbeddedService._require
        raise WrongRole(f"this service is {runtime.role}", field="role", role=runtime.role)
    return runtime


def _decode_of(runtime: RuntimeBase) -> DecodePipeline:
    return _decode_runtime(runtime).pipeline


def _check_buffers(config: Config, buffers: dict[int, list[Any] | EngineStage]) -> None:
    """The engine's buffers against every stage's layout, before anything starts: exactly the
    configured stages, one buffer per entry, each large enough. Raises ConfigError naming the
    stage and the entry."""
    hosted = sorted(s.pp_rank for s in config.stages)
    if sorted(buffers) != hosted:
        raise ConfigError(
            "buffers",
            f"buffers are given for stages {sorted(buffers)}; this service hosts stages {hosted}",
        )
    for rank in hosted:
        entry = buffers[rank]
        if isinstance(entry, EngineStage):
            layout, given = entry.layout, list(entry.buffers)
        else:
            layout, given = embedded_layout(config, rank), entry
        sizes = layout.region_sizes
        if len(given) != len(sizes):
            raise ConfigError(
                f"buffers[{rank}]",
                f"stage {rank} needs {len(sizes)} buffers ({len(layout.kv)} KV entries, then "
                f"{len(layout.state)} state entries; see embedded_layout), got {len(given)}",
            )
        for j, (buffer, size) in enumerate(zip(given, sizes)):
            length = _buffer_length(buffer, f"buffers[{rank}][{j}]")
            if length < size:
                raise ConfigError(
                    f"buffers[{rank}][{j}]",
                    f"stage {rank} entry {j} ({_describe(layout, j)}) needs {size} bytes, "
                    f"the buffer holds {length}",
                )


def _buffer_length(buffer: Any, field: str) -> int:
    if isinstance(buffer, tuple):
        return int(buffer[1])
    if not buffer.is_contiguous():
        raise ConfigError(field, "embedded tensors must be contiguous")
    return int(buffer.numel() * buffer.element_size())


def _describe(layout: StageLayout, index: int) -> str:
    if index < len(layout.kv):
        e = layout.kv[index]
        return f"KV of layer {e.layer_id} group {e.group}"
    s = layout.state[index - len(layout.kv)]
    return f"{s.kind} state of layer {s.layer_id}"


def _check_id(handoff_id: str) -> None:
    try:
        msgspec.convert(handoff_id, HandoffId)
    except msgspec.ValidationError as exc:
        raise InvalidInput(f"handoff_id {handoff_id!r}: {exc}", field="handoff_id") from None


def _check_decode_url(url: str | None) -> None:
    if url is not None:
        try:
            msgspec.convert(url, ServiceUrl)
        except msgspec.ValidationError as exc:
            raise InvalidInput(f"decode_url {url!r}: {exc}", field="decode_url") from None


def _request_slots(
    src_slot: int | None, src_slots: Mapping[str, int] | None, src_aux: int | None
) -> RequestSlots:
    """The request's slot indices as the engine named them, each checked (`_non_negative`)."""
    return RequestSlots(
        None if src_slot is None else _non_negative(src_slot, "src_slot"),
        {str(c): _non_negative(i, f"src_slots.{c}") for c, i in (src_slots or {}).items()},
        None if src_aux is None else _non_negative(src_aux, "src_aux"),
    )


def _optional_bool(value: object, field: str) -> bool | None:
    """`value` as a bool (numpy's included), None as None; InvalidInput naming `field` else."""
    if value is None:
        return None
    if not isinstance(value, bool | np.bool_):
        raise InvalidInput(f"{field} must be a bool, got {type(value).__name__}", field=field)
    return bool(value)


def _non_negative(value: Any, field: str) -> int:
    try:
        number = operator.index(value)  # ints and numpy integers, never floats
    except TypeError:
        number = -1
    if isinstance(value, bool) or number < 0:
        raise InvalidInput(f"{field} = {value!r} is not a non-negative integer", field=field)
    return number


def _checked_request(request: HandoffRequest) -> HandoffRequest:
    """The request through the same validation as the HTTP body (a Struct's constructor checks
    no constraint), as a fresh copy: numpy page arrays become lists, later edits do not leak in.
    """
    try:
        raw = msgspec.to_builtins(request, enc_hook=_numpy_hook)
    except TypeError as exc:
        raise InvalidInput(
            f"the request holds a value JSON cannot carry: {exc}", field="$"
        ) from None
    try:
        return msgspec.convert(raw, HandoffRequest)
    except msgspec.ValidationError as exc:
        raise invalid_value(exc) from None


def _numpy_hook(value: Any) -> Any:
    if isinstance(value, np.ndarray | np.generic):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not supported")
