"""kvarn.run.ahead: a producer of chunk slices run ahead in a thread, the same items in the same order."""

import threading
import time

import pytest

from kvarn.run.ahead import ahead


def test_the_same_nesting_and_order():
    chunks = [[1, 2, 3], [], [4], [5, 6]]
    assert [list(c) for c in ahead(chunks, 1)] == chunks
    assert [list(c) for c in ahead(iter(map(iter, chunks)), 3)] == chunks
    assert [list(c) for c in ahead([], 2)] == []


def test_a_chunk_left_unread_is_skipped_whole():
    got = []
    for i, c in enumerate(ahead([[1, 2], [3, 4], [5]], 2)):
        if i != 1:
            got.append(list(c))
    assert got == [[1, 2], [5]]


def test_the_producer_runs_ahead_by_depth():
    made = []

    def chunk():
        for i in range(20):
            made.append(i)
            yield i

    it = ahead([chunk()], 3)
    first = next(it)
    assert next(first) == 0
    deadline = time.monotonic() + 10
    while len(made) < 4 and time.monotonic() < deadline:  # 0 taken, 3 queued ahead, one more in hand
        time.sleep(0.01)
    time.sleep(0.1)
    assert 4 <= len(made) <= 5  # never more than depth (+ the one waiting to be queued) ahead
    assert list(first) == list(range(1, 20)) and made == list(range(20))
    it.close()


def test_an_error_in_the_producer_is_raised_where_it_happened():
    def chunk():
        yield 1
        yield 2
        raise ZeroDivisionError("in the forward")

    got = []
    with pytest.raises(ZeroDivisionError, match="in the forward"):
        for c in ahead([chunk(), [9]], 2):
            for x in c:
                got.append(x)
    assert got == [1, 2]


def test_a_consumer_that_stops_stops_the_producer():
    def endless():
        i = 0
        while True:
            yield i
            i += 1

    before = threading.active_count()
    it = ahead([endless()], 2)
    assert next(next(it)) == 0
    it.close()  # the writer failed: the thread ends, it does not run on
    assert threading.active_count() == before
    with pytest.raises(ValueError, match="depth must be an integer >= 1, got 0"):
        next(ahead([[1]], 0))


def test_closing_frees_a_producer_blocked_on_a_full_queue():
    """The producer waits on a full queue in short timed puts, so a consumer that stops while it waits
    (the queue full, depth items ahead) ends it at once: close() returns, the thread is gone."""
    def endless():
        i = 0
        while True:
            yield i
            i += 1

    it = ahead([endless()], 1)
    assert next(next(it)) == 0
    time.sleep(0.3)  # the producer has filled the queue (1 item) and waits to put the next
    closer = threading.Thread(target=it.close, daemon=True)
    closer.start()
    closer.join(timeout=5)
    assert not closer.is_alive(), "close() hangs on a producer blocked in put()"
    assert not [t for t in threading.enumerate() if t.name == "kvarn-ahead"]


def test_the_producer_is_a_named_daemon_thread():
    """The producer runs in a daemon thread named kvarn-ahead: a hung forward never keeps the process
    alive at exit, and a thread dump names it."""
    seen = []

    def chunk():
        t = threading.current_thread()
        seen.append((t.name, t.daemon, t is threading.main_thread()))
        yield 1

    assert [list(c) for c in ahead([chunk()], 1)] == [[1]]
    assert seen == [("kvarn-ahead", True, False)]
