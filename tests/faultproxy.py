"""A TCP proxy on 127.0.0.1 in front of a test server, that can make the server misbehave the
way networks do: go away in the middle of a response, stall in the middle of one, or accept
connections and never answer (for the object-store fault and deadline tests).

``FaultProxy(upstream_port)`` forwards every connection. ``arm(budget, fault)`` lets ``budget``
more bytes of responses through, then: "vanish" closes every connection and stops accepting
(the endpoint went away), "stall" keeps the connections open and sends nothing more.
``silent()`` is a listener that accepts connections and never answers.
"""

from __future__ import annotations

import socket
import threading
from typing import Literal


def _listener() -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    return sock


class FaultProxy:
    """Forwards 127.0.0.1:<port> to 127.0.0.1:<upstream_port>, with faults on demand."""

    def __init__(self, upstream_port: int) -> None:
        self._upstream = upstream_port
        self._sock = _listener()
        self.port = self._sock.getsockname()[1]
        self._lock = threading.Lock()
        self._budget: int | None = None  # response bytes still let through once armed
        self._fault: Literal["vanish", "stall"] = "vanish"
        self._open: list[socket.socket] = []
        self._gone = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def arm(self, budget: int, fault: Literal["vanish", "stall"]) -> None:
        with self._lock:
            self._budget, self._fault = budget, fault

    def _accept(self) -> None:
        while not self._gone.is_set():
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self._upstream))
            with self._lock:
                self._open += [client, server]
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, response: bool) -> None:
        stalled = False
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                strike = False
                if response:
                    data, strike = self._take(data)
                if data:
                    dst.sendall(data)
                if strike:
                    if self._fault == "vanish":
                        self.close()
                    stalled = True  # "stall": both connections stay open, nothing more is sent
                    return
        except OSError:
            pass
        finally:
            if not stalled:
                for s in (src, dst):
                    try:
                        s.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass

    def _take(self, data: bytes) -> tuple[bytes, bool]:
        """The part of ``data`` the budget lets through, and whether the fault strikes now."""
        with self._lock:
            if self._budget is None:
                return data, False
            take = min(len(data), self._budget)
            self._budget -= take
            return data[:take], self._budget == 0

    def close(self) -> None:
        """Stop accepting and close every connection (the endpoint is gone)."""
        self._gone.set()
        try:
            self._sock.close()
        except OSError:
            pass
        with self._lock:
            conns, self._open = self._open, []
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()


def silent() -> tuple[socket.socket, list[socket.socket]]:
    """A listener on 127.0.0.1 that accepts every connection and never answers: (its socket, the
    connections it accepted); close both when done."""
    sock = _listener()
    accepted: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            accepted.append(conn)

    threading.Thread(target=accept, daemon=True).start()
    return sock, accepted
