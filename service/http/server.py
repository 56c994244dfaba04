"""The app runner `kvhandoff.service.serve` starts: aiohttp's, with its own errors as problem+json.

A request aiohttp's HTTP parser refuses (an over-long request line or header, bad chunking,
`HTTP/9.9`, Content-Length together with Transfer-Encoding) never reaches the app or its error
middleware; aiohttp answers it from the protocol handler as `400 text/plain`. `ProblemAppRunner`
swaps that handler's error page for the same RFC 9457 body every other error gets, so a client
parses one error format whatever refused it.
"""

from __future__ import annotations

from http import HTTPStatus

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from kvhandoff.service.http.problems import PROBLEM_CONTENT_TYPE, encode_problem, problem_body


class _ProblemRequestHandler(RequestHandler):
    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        # aiohttp's own handling logs the error and refuses when a response already started.
        super().handle_error(request, status, exc, message)
        if status >= 500:
            code, detail = "internal_error", "an unexpected error occurred; see the service log"
        else:
            code = "bad_request"
            detail = f"the HTTP request is malformed: {message or exc or HTTPStatus(status).phrase}"
        body = problem_body(status=status, code=code, detail=detail, instance="")
        response = web.Response(
            status=status, body=encode_problem(body), content_type=PROBLEM_CONTENT_TYPE
        )
        response.force_close()
        return response


class _ProblemServer(web.Server):
    def __call__(self) -> RequestHandler:
        return _ProblemRequestHandler(self, loop=self._loop, **self._kwargs)


class ProblemAppRunner(web.AppRunner):
    """`web.AppRunner` whose connections answer parser errors as problem+json."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        # Same state, one method different: aiohttp builds the Server inside the app, so the
        # class is swapped rather than the Server rebuilt from its private arguments.
        server.__class__ = _ProblemServer
        return server
