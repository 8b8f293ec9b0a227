"""Events a test completes by hand, for the allocator cores' event-gated frees."""

from __future__ import annotations

from hypothesis import strategies as st


class FakeEvent:
    """An event the test completes by hand; ``synchronize`` completes it (as a
    real wait would) and counts the calls."""

    def __init__(self):
        self.done = False
        self.syncs = 0

    def query(self):
        return self.done

    def synchronize(self):
        self.syncs += 1
        self.done = True


class StreamEvent(FakeEvent):
    """A FakeEvent recorded on a stream of a model: completing it completes every
    event recorded earlier on that stream (CUDA's in-order rule, which the
    allocator's FIFO polling and stamping rely on)."""

    def __init__(self, log, stream):
        super().__init__()
        self.stream, self.log = stream, log
        log.append(self)

    def complete(self):
        for ev in self.log[:self.log.index(self) + 1]:
            if ev.stream == self.stream:
                ev.done = True

    def synchronize(self):
        self.syncs += 1
        self.complete()


def overlaps(a, b):
    return a.slab == b.slab and a.offset < b.end and b.offset < a.end


def complete_one(events, data) -> None:
    """Complete one of ``events`` not yet done, drawn by hypothesis's ``data``
    (a stateful machine's rule; nothing when all are done)."""
    pending = [e for e in events if not e.done]
    if pending:
        data.draw(st.sampled_from(pending)).complete()
