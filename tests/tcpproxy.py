"""A TCP proxy on loopback in front of a real server, that can lose a reply: armed, it forwards the client's next
request to the server, then closes the connection before the server's reply reaches the client. So a test makes
the failure a retry must survive (the command ran; its caller never heard), with the real server on the far side."""

from __future__ import annotations

import socket
import threading


class LossyProxy:
    def __init__(self, target_port: int, target_host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.port = self.listener.getsockname()[1]
        self._armed = 0
        self._match = b""
        self._lock = threading.Lock()
        self.lost = 0  # replies lost so far
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def lose_next_reply(self, to: bytes = b"EVALSHA", times: int = 1) -> None:
        """The next ``times`` requests that hold ``to`` (a command's name: the broker's writes are its Lua scripts)
        run on the server, and their connections close before the reply."""
        with self._lock:
            self._armed, self._match = self._armed + times, to

    def _take(self, data: bytes) -> bool:
        with self._lock:
            if self._armed and self._match.lower() in data.lower():
                self._armed -= 1
                return True
            return False

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            threading.Thread(target=self._pipe, args=(client, server), daemon=True).start()

    def _pipe(self, client: socket.socket, server: socket.socket) -> None:
        """One connection, a thread each way. A request forwarded while armed marks the connection: the server's next
        bytes (its reply: the command has run) are dropped, and both ends closed."""
        cut = threading.Event()

        def close() -> None:
            for s in (client, server):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

        def upstream() -> None:
            try:
                while data := client.recv(1 << 20):
                    if self._take(data):
                        cut.set()
                    server.sendall(data)
            except OSError:
                pass
            finally:
                if not cut.is_set():
                    close()

        threading.Thread(target=upstream, daemon=True).start()
        try:
            while data := server.recv(1 << 20):
                if cut.is_set():
                    self.lost += 1
                    break
                client.sendall(data)
        except OSError:
            pass
        finally:
            close()

    def close(self) -> None:
        self._stop.set()
        self.listener.close()


class LaggingProxy:
    """A TCP proxy on loopback that can fall behind: held, it stops passing the server's bytes on (it keeps them),
    as a slow or cut link would; when the server then dies, what it kept is dropped. In front of a Redis primary,
    for its replica: the replication stream stops reaching the replica while the primary goes on acknowledging."""

    def __init__(self, target_port: int) -> None:
        self.target = ("127.0.0.1", target_port)
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.port = self.listener.getsockname()[1]
        self.held = threading.Event()
        self.kept = 0  # bytes kept back while held
        threading.Thread(target=self._accept, daemon=True).start()

    def hold(self) -> None:
        self.held.set()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            threading.Thread(target=self._pipe, args=(client, server), daemon=True).start()

    def _pipe(self, client: socket.socket, server: socket.socket) -> None:
        def close() -> None:
            for s in (client, server):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

        def upstream() -> None:
            try:
                while data := client.recv(1 << 16):
                    server.sendall(data)
            except OSError:
                pass
            finally:
                close()

        threading.Thread(target=upstream, daemon=True).start()
        try:
            while data := server.recv(1 << 16):
                if self.held.is_set():
                    self.kept += len(data)  # kept back; never passed on
                    continue
                client.sendall(data)
        except OSError:
            pass
        finally:
            close()

    def close(self) -> None:
        self.listener.close()
