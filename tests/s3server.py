"""moto's S3 server on 127.0.0.1 for the object-store tests, with a request counter.

The server is real HTTP on a free loopback port (``port=0``): every test talks to it through
s3fs/botocore exactly as it would to S3. ``Traffic`` counts what reaches it.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Callable, Iterable

#: The credentials and region the fixtures put in the environment (moto accepts any).
ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
       "AWS_SESSION_TOKEN": "testing"}


@dataclass
class Traffic:
    """Requests seen by the server: (method, path, Range header, response body bytes)."""

    requests: list[tuple[str, str, str, int]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def clear(self) -> None:
        with self.lock:
            self.requests.clear()

    def gets(self) -> list[tuple[str, str, str, int]]:
        with self.lock:
            return [r for r in self.requests if r[0] == "GET"]

    @property
    def bytes_sent(self) -> int:
        with self.lock:
            return sum(r[3] for r in self.requests)


class _Counting:
    """WSGI middleware recording each request and the bytes of its response body."""

    def __init__(self, app: Callable[..., Iterable[bytes]], traffic: Traffic) -> None:
        self.app, self.traffic = app, traffic

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        body = self.app(environ, start_response)
        chunks = list(body)
        if hasattr(body, "close"):
            body.close()
        with self.traffic.lock:
            self.traffic.requests.append((environ["REQUEST_METHOD"], environ.get("PATH_INFO", ""),
                                          environ.get("HTTP_RANGE", ""), sum(len(c) for c in chunks)))
        return chunks


class S3Server:
    """Start moto's ThreadedMotoServer on 127.0.0.1 (a free port) and point botocore at it."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.traffic = Traffic()
        self._saved_env: dict[str, str | None] = {}

    def start(self) -> str:
        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
        self._server.start()
        wsgi = self._server._server  # the werkzeug server: count what its app answers
        wsgi.app = _Counting(wsgi.app, self.traffic)
        host, port = self._server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        for name, value in {**ENV, "AWS_ENDPOINT_URL": self.endpoint}.items():
            self._saved_env[name] = os.environ.get(name)
            os.environ[name] = value
        return self.endpoint

    def stop(self) -> None:
        self._server.stop()
        for name, value in self._saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
