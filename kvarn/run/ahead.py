"""Run a producer of chunk slices ahead of its consumer, in a thread: the baseline's forward keeps
going while the dump's writer encodes what came before (`kvarn.run.torch_engine.run_baseline`).

`ahead(chunks, depth)` takes an iterable of chunks, each an iterable of items (the forward's
log-prob slices), and returns the same nesting, items in the same order, while a background
thread computes up to `depth` items ahead. On a GPU the writer's host work (encoding a slice)
then overlaps the device's forward of the next; the items and their order are the same as
without it, so the dump is the same bytes (tested).

An exception in the producer is raised in the consumer at the item where it happened; a
consumer that stops early (an error in the writer, a chunk left unread) stops the producer
at its next item.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")

_END_CHUNK = object()
_DONE = object()


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error


def ahead(chunks: Iterable[Iterable[T]], depth: int = 2) -> Iterator[Iterator[T]]:
    """`chunks` (an iterable of iterables), produced in a thread up to `depth` items ahead."""
    if not isinstance(depth, int) or depth < 1:
        raise ValueError(f"ahead: depth must be an integer >= 1, got {depth!r}")
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce():
        try:
            for chunk in chunks:
                for item in chunk:
                    if not put(item):
                        return
                if not put(_END_CHUNK):
                    return
            put(_DONE)
        except BaseException as e:  # handed to the consumer, raised there
            put(_Failed(e))

    thread = threading.Thread(target=produce, name="kvarn-ahead", daemon=True)
    thread.start()

    def take():
        item = q.get()
        if isinstance(item, _Failed):
            raise item.error
        return item

    def one_chunk(first):
        item = first
        while item is not _END_CHUNK:
            yield item
            item = take()

    try:
        while True:
            first = take()
            if first is _DONE:
                return
            chunk = one_chunk(first)
            yield chunk
            for _ in chunk:  # a chunk the consumer did not read to its end is drained
                pass
    finally:
        stop.set()
        thread.join()
