"""The HTTP judge's transport: one POST with a deadline over the whole request (connect, send, every read), no
redirects, and a response body read up to :data:`JUDGE_MAX_RESPONSE_BYTES`."""

from __future__ import annotations

import functools
import http.client
import threading
import time
import urllib.error
import urllib.request

JUDGE_MAX_RESPONSE_BYTES = 1 << 20  # the most of a judge's response body read: a verdict is a few hundred bytes


class RequestDeadline:
    """A whole request's time limit: each connect and read waits at most what is left, and when
    the time is up the connection's socket is shut down, which ends a read a server trickles."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.end = time.monotonic() + seconds
        self.expired = False
        self._sock = None
        self._lock = threading.Lock()
        self._timer = threading.Timer(seconds, self.expire)
        self._timer.daemon = True
        self._timer.start()

    def left(self) -> float:
        """Seconds left (at least a millisecond: a socket timeout of 0 would mean non-blocking)."""
        return max(self.end - time.monotonic(), 1e-3)

    def attach(self, sock) -> None:
        """Shut ``sock`` down when the deadline passes (at once if it has)."""
        with self._lock:
            self._sock = sock
            expired = self.expired
        if expired:
            self._shutdown(sock)

    def expire(self) -> None:
        with self._lock:
            self.expired = True
            sock = self._sock
        if sock is not None:
            self._shutdown(sock)

    def cancel(self) -> None:
        self._timer.cancel()

    @staticmethod
    def _shutdown(sock) -> None:
        import socket

        try:
            socket.socket.shutdown(sock, socket.SHUT_RDWR)  # the socket's own call (an SSLSocket's would unwrap TLS)
        except OSError:
            pass


class _DeadlineConnection:
    """Mixed into ``http.client``'s connections: connect within the deadline, then hand it the socket."""

    def __init__(self, *args, deadline: RequestDeadline, **kwargs):
        super().__init__(*args, **kwargs)
        self.deadline = deadline

    def connect(self):
        self.timeout = self.deadline.left()  # also each later read's socket timeout
        super().connect()
        self.deadline.attach(self.sock)


class _DeadlineHTTPConnection(_DeadlineConnection, http.client.HTTPConnection):
    pass


class _DeadlineHTTPSConnection(_DeadlineConnection, http.client.HTTPSConnection):
    pass


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None  # not followed: urllib raises the 3xx as an HTTPError, and the key goes nowhere else


class ResponseTooLargeError(ValueError):
    """A response body longer than :data:`JUDGE_MAX_RESPONSE_BYTES`."""


def post(url: str, data: bytes, headers: dict, timeout: float) -> bytes:
    """POST ``data`` to ``url`` and return the body (at most :data:`JUDGE_MAX_RESPONSE_BYTES`), connect and every read
    within ``timeout`` seconds, redirects not followed; raises HTTPError (not 2xx), TimeoutError, OSError, HTTPException
    or ResponseTooLargeError."""
    deadline = RequestDeadline(timeout)

    class HTTPHandler(urllib.request.HTTPHandler):
        def http_open(self, req):
            return self.do_open(functools.partial(_DeadlineHTTPConnection, deadline=deadline), req)

    class HTTPSHandler(urllib.request.HTTPSHandler):
        def https_open(self, req):
            return self.do_open(functools.partial(_DeadlineHTTPSConnection, deadline=deadline), req, context=self._context)

    opener = urllib.request.build_opener(HTTPHandler, HTTPSHandler, _NoRedirects)
    request = urllib.request.Request(url, data=data, headers=headers, method="POST")
    try:
        with opener.open(request, timeout=timeout) as response:
            body = response.read(JUDGE_MAX_RESPONSE_BYTES + 1)  # one byte more tells a body over the limit
    except (OSError, http.client.HTTPException):
        if deadline.expired:  # the socket was shut down at the deadline
            raise TimeoutError(f"timed out: no whole response within judge.timeout={timeout:g} s") from None
        raise
    finally:
        deadline.cancel()
    if deadline.expired:  # a body cut short at the deadline
        raise TimeoutError(f"timed out: no whole response within judge.timeout={timeout:g} s")
    if len(body) > JUDGE_MAX_RESPONSE_BYTES:
        raise ResponseTooLargeError(
            f"the response from {url} is longer than {JUDGE_MAX_RESPONSE_BYTES} bytes, the most a judge's answer is read "
            "(a chat-completions answer is a few hundred bytes: check that judge.base_url is the judge's API)"
        )
    return body


# ----------------------------------------------------------------------------- reward functions
