"""An HTTP receiver that answers a byte at a time: a callback's deadline must bound the whole POST."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable


def trickling_receiver(pause: float, path: str = "/hook?token=s3cret") -> tuple[str, Callable[[], None]]:
    """A receiver on 127.0.0.1 that reads each request, then answers one byte every ``pause``
    seconds; returns its URL (``path`` on it) and what stops it."""
    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    listening.listen(4)
    done = threading.Event()

    def answer() -> None:
        while not done.is_set():
            try:
                connection, _address = listening.accept()
            except OSError:
                return
            try:
                connection.recv(65536)
                for byte in b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n":
                    if done.is_set():
                        break
                    connection.send(bytes([byte]))
                    time.sleep(pause)
            except OSError:
                pass
            finally:
                connection.close()

    def stop() -> None:
        done.set()
        listening.close()

    threading.Thread(target=answer, daemon=True).start()
    return f"http://127.0.0.1:{listening.getsockname()[1]}{path}", stop
