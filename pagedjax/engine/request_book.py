"""The engine's host bookkeeping: requests by id, sequences waiting for a slot, slot owners.

What lives here is plain Python state that never goes to the device: which request owns
which scheduler slot, the FCFS queue of sequences without a slot (new requests, samples
that found no free slot at fork time), the free slots, the arrival counter that orders
the scheduler's FCFS, and the slot sets the prefix cache and swap need between steps.
The one-step path (``llm_engine``), the decode loop (``multi_step``) and beam search
(``beams``) change it only through the methods below, so the invariants hold in one place:

- a slot is in exactly one of ``free_slots`` and ``slot_owner``;
- ``seq.slot`` is the slot whose owner is ``seq``, or None;
- a request is in ``requests`` from ``add`` until its output reports it finished (or it is
  aborted); its queued sequences are dropped with it.

Cost: every method is O(1) except ``drop`` (O(queue length)).
"""

from __future__ import annotations

from collections import deque

from pagedjax.engine.sequence import RequestState, SequenceState


class RequestBook:
    """Host-side state of one engine (see the module docstring).

    max_seqs: the scheduler's slots. eos_ids: token ids that end a sequence unless its
    params say ``ignore_eos`` (the model's and the tokenizer's EOS ids).
    """

    def __init__(self, max_seqs: int, eos_ids: set[int]):
        self.max_seqs = max_seqs
        self.eos: set[int] = set(eos_ids)
        self.requests: dict[str, RequestState] = {}
        self.queue: deque[tuple[RequestState, SequenceState]] = deque()  # without a slot
        self.slot_owner: dict[int, tuple[RequestState, SequenceState]] = {}
        self.free_slots: list[int] = list(range(max_seqs - 1, -1, -1))  # pop(): slot 0 first
        # Slots whose group is swapped out to the host pool (no admission meanwhile).
        self.swapped_slots: set[int] = set()
        # Slots preempted by recompute: look their prefix up again at re-admission.
        self.relookup: set[int] = set()
        self.num_arrivals = 0

    # ------------------------------------------------------------------ requests

    def request_counts(self) -> dict[str, int]:
        """Unfinished requests by where they are (serving metrics; host state, no device
        sync): "swapped" has a sample swapped out to the host pool, "running" holds a
        scheduler slot otherwise (it may still wait on the device for blocks), "waiting"
        holds no slot yet; "slots_in_use" counts occupied scheduler slots."""
        running = swapped = 0
        for req in self.requests.values():
            slots = [s.slot for s in req.seqs if s.slot is not None]
            if any(s in self.swapped_slots for s in slots):
                swapped += 1
            elif slots:
                running += 1
        return dict(
            running=running,
            waiting=len(self.requests) - running - swapped,
            swapped=swapped,
            slots_in_use=len(self.slot_owner),
        )

    def next_arrival(self) -> int:
        """A new FCFS key (one per sequence, increasing)."""
        arrival = self.num_arrivals
        self.num_arrivals += 1
        return arrival

    def add(self, req: RequestState) -> None:
        """Register a request whose sequences are built: sample 0 joins the queue; samples
        1..n-1 wait in ``req.pending`` to fork sample 0's prompt blocks."""
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self.queue.append((req, req.seqs[0]))
        req.pending = req.seqs[1:]
        self.requests[req.request_id] = req

    def drop(self, request_id: str) -> RequestState | None:
        """Forget a request (abort): it leaves ``requests`` and the queue. Its slots are
        the caller's to release (the device state must drop them too). None if unknown."""
        req = self.requests.pop(request_id, None)
        if req is not None:
            self.queue = deque(x for x in self.queue if x[0] is not req)
        return req

    def unqueue(self, req: RequestState, seqs: list[SequenceState]) -> None:
        """Take these sequences of ``req`` out of the queue (samples ended while queued)."""
        gone = {id(s) for s in seqs}
        self.queue = deque(x for x in self.queue if not (x[0] is req and id(x[1]) in gone))

    def is_live(self, req: RequestState) -> bool:
        """Whether ``req`` is still the request registered under its id (not finished,
        not aborted, not replaced by a new request reusing the id)."""
        return self.requests.get(req.request_id) is req

    def retire(self, request_id: str) -> None:
        """Forget a finished request (its output said so)."""
        del self.requests[request_id]

    def requeue_front(self, req: RequestState, seqs: list[SequenceState]) -> None:
        """Put sequences back at the head of the queue, in order (forked samples that
        found no free slot)."""
        self.queue.extendleft((req, s) for s in reversed(seqs))

    # ------------------------------------------------------------------ slots

    def bind_slot(self, req: RequestState, seq: SequenceState) -> int:
        """Give ``seq`` a free slot (the lowest-numbered first). Raises IndexError when
        none is free (callers check ``free_slots``)."""
        slot = self.free_slots.pop()
        seq.slot = slot
        self.slot_owner[slot] = (req, seq)
        return slot

    def release_slot(self, seq: SequenceState) -> None:
        """The slot of ``seq`` becomes free (finished, rejected or aborted)."""
        if seq.slot is None:
            raise ValueError("the sequence holds no slot")
        del self.slot_owner[seq.slot]
        self.swapped_slots.discard(seq.slot)
        self.free_slots.append(seq.slot)
        seq.slot = None

    def owner(self, slot: int) -> tuple[RequestState, SequenceState]:
        """(request, sequence) holding ``slot``; KeyError if it is free."""
        return self.slot_owner[slot]

    def stop_ids(self, seq: SequenceState) -> set[int]:
        """Token ids that finish ``seq``: its stop_token_ids, and EOS unless ignore_eos
        (EOS always, on the device, for a device-FSM sequence: after its grammar's EOS
        nothing is allowed, so the host finishes it there, as the host-mask path does)."""
        ids = set(seq.params.stop_token_ids)
        if not seq.params.ignore_eos or seq.fsm is not None:
            ids |= self.eos
        return ids


__all__ = ["RequestBook"]
