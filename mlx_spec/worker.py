"""The one thread that runs MLX, for the server's batch and the chat.

Every MLX call of `mlx-spec serve` and `mlx-spec chat` runs on one long-lived
daemon thread: MLX's streams belong to the thread that made them, and a thread
that ran MLX and ended without clearing them may abort the process at exit
(mlx #3126). A subclass says what one turn is (a job of the chat, a round of the
server's batch) and what a failed turn leaves behind.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod

import mlx.core as mx

from mlx_spec import distributed


class Worker(ABC):
    """A daemon thread calling `turn` until it returns True; what a turn raises goes to `failed`."""

    def __init__(self, name: str):
        self.thread = threading.Thread(target=self._main, name=name, daemon=True)

    def start(self) -> None:
        self.thread.start()

    @abstractmethod
    def turn(self) -> bool:
        """One unit of work; True when the worker is to stop."""

    @abstractmethod
    def failed(self, error: Exception) -> None:
        """A turn raised `error`; the worker goes on after this."""

    def finished(self) -> None:
        """The last words, on the worker's thread, once `turn` has said stop."""

    def _main(self) -> None:
        distributed.seed_thread()
        while True:
            try:
                if self.turn():
                    break
            except Exception as e:
                distributed.check(e)  # under --shard, a rank lost ends the run
                self.failed(e)
        self.finished()
        mx.clear_streams()
