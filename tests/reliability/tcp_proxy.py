"""A TCP proxy a test can cut and restore: placed between the api and Postgres, it makes the
database unreachable to the api alone, while the shared Postgres server keeps serving the other
tests.

Cut: every open connection is torn down and new ones are closed as soon as they are accepted (the
client sees a reset, as with a server that went away, not a hang). Restore: connections are
forwarded again. One thread accepts; two threads pump each connection.
"""

from __future__ import annotations

import contextlib
import socket
import threading

CHUNK = 65536


class TcpProxy:
    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._is_cut = False
        self._is_closed = False
        self._acceptor = threading.Thread(target=self._accept, name="proxy-accept", daemon=True)
        self._acceptor.start()

    def cut(self) -> None:
        """From now on the upstream is unreachable through the proxy."""
        with self._lock:
            self._is_cut = True
            sockets, self._open = self._open, set()
        for sock in sockets:
            _close(sock)

    def restore(self) -> None:
        with self._lock:
            self._is_cut = False

    def close(self) -> None:
        self._is_closed = True
        self.cut()
        _close(self._listener)
        self._acceptor.join(5)

    def _accept(self) -> None:
        while not self._is_closed:
            try:
                client, _ = self._listener.accept()
            except OSError:  # the listener was closed
                return
            with self._lock:
                is_cut = self._is_cut
            if is_cut:
                _close(client)
                continue
            try:
                server = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                _close(client)
                continue
            server.settimeout(None)
            self._forward(client, server)

    def _forward(self, client: socket.socket, server: socket.socket) -> None:
        with self._lock:
            is_cut = self._is_cut
            if not is_cut:
                self._open |= {client, server}
        if is_cut:  # cut while this one was connecting upstream
            _close(client)
            _close(server)
            return
        for source, sink in ((client, server), (server, client)):
            threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(CHUNK):
                sink.sendall(data)
        for sock in (source, sink):
            with self._lock:
                self._open.discard(sock)
            _close(sock)


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()
