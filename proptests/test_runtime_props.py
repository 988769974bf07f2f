"""Properties of the runtime's work queue (shared_svc.runtime.workqueue) over any sequence
of adds, hand-outs and dones: a key is never handed out twice at once, an added key is
never lost, and a key waiting is queued once."""

from __future__ import annotations

import asyncio

from hypothesis import given
from hypothesis import strategies as st

from shared_svc.runtime.workqueue import WorkQueue

KEYS = st.sampled_from("abcd")
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("add"), KEYS),
        st.tuples(st.just("get"), st.just("")),
        st.tuples(st.just("done"), st.integers(0, 3)),
    ),
    max_size=60,
)


async def _run(ops: list[tuple[str, object]]) -> None:
    queue: WorkQueue[str] = WorkQueue("props")
    in_flight: list[str] = []
    owed: set[str] = set()  # added since last handed out: must be handed out again
    for op, arg in ops:
        if op == "add":
            key = str(arg)
            queue.add(key)
            owed.add(key)
        elif op == "get" and len(queue):
            key = await queue.get()
            assert key not in in_flight, "handed out twice at once"
            in_flight.append(key)
            owed.discard(key)
        elif op == "done" and in_flight:
            queue.done(in_flight.pop(int(str(arg)) % len(in_flight)))
        # dedup: every key waits at most once, and a key in flight is not waiting
        waiting = list(queue._order)
        assert len(waiting) == len(set(waiting)) == len(queue)
        assert not set(waiting) & set(in_flight)
        assert owed <= set(waiting) | set(queue._dirty)
    # Drain: everything owed comes out, each key once at a time.
    while in_flight:
        queue.done(in_flight.pop())
    while len(queue):
        key = await queue.get()
        owed.discard(key)
        queue.done(key)
    assert owed == set(), "an added key was lost"


@given(OPS)
def test_queue_never_hands_out_a_key_twice_and_never_loses_one(
    ops: list[tuple[str, object]],
) -> None:
    asyncio.run(_run(ops))
