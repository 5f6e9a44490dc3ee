"""Input that keeps arriving while a request runs: turns on one KV cache.

A walk with `more_input` (Orpheus's `speak`: text to say; an omni model's
audio) takes more of those inputs after it started. Each piece is a turn of
the root partition: when the partition's top-level loop ends (a stop token
or its cap), the partition does not finish while the request's input is
open. It waits for the next piece, then starts over at its first step with
the piece, joined to what came before by the model (`join_turn`: the turn's
last sampled token, which the cache has not seen yet, the model's turn
markers, positions going on from the cache's). The KV cache is kept, so only
the new piece is prefilled. A turn leaves room in the context for the piece
queued next: when the piece arrives (or the turn starts with one queued),
the turn may take half of what the context has left besides that piece's
tokens, and its loop stops ("length") there; the piece's turn has the rest.
So input the engine took while a turn spoke is spoken, not dropped at a full
context. (Room for the next piece only: reserving for every queued piece
would starve every turn once more is queued than the context holds.) The partition's streams cut their tails as at the
end of a stream and count a new segment, so each turn's audio is what a
request of its own would have given; a consumer whose stream restarts at
each turn runs again from its first node.

The worker calls `append` and `close` from its inbox; `on_awaiting` tells the
event loop that a request has caught up with all its input.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from mstar.engine.worker.rows import PartitionRun
from mstar.models.prepared import PreparedPiece
from mstar.engine.movement.tensor_store import TensorRef
from mstar.graph import Loop

if TYPE_CHECKING:
    from mstar.engine.worker.walker import Walker

# (the turn's last token, the piece by input name, the position it starts at) -> the next turn's values
JoinTurn = Callable[[int, dict[str, torch.Tensor], int], PreparedPiece]
# tokens a queued piece takes besides its own: the turn's last token and the model's turn markers (Orpheus 3,
# Qwen3-Omni 2), and its turn's first written token
TURN_MARGIN = 8


class Turns:
    def __init__(self, walker: Walker, join_turn: JoinTurn | None,
                 on_awaiting: Callable[[str, int], None] | None, min_turn_tokens: int = 1) -> None:
        self.walker = walker
        self.join_turn = join_turn
        self.min_turn_tokens = min_turn_tokens  # the model's: less room than this and a turn answers nothing
        self.on_awaiting = on_awaiting or (lambda request_id, context_tokens: None)

    def _root(self, request_id: str) -> PartitionRun | None:
        run = self.walker.runs.get(request_id)
        if run is None or run.walk.more_input is None:
            return None
        part = run.partitions.get(run.walk.root)
        return None if part is None or part.done else part

    # ---------------------------------------------------- from the inbox

    def append(self, request_id: str, values: dict[str, torch.Tensor], num_tokens: int = 0) -> None:
        """One more piece of input for a running request, by walk input name,
        of `num_tokens` prompt tokens (ignored once it has ended, or after
        `close`). A turn under way leaves it room."""
        part = self._root(request_id)
        if part is None or not part.request.input_open:
            return
        part.request.more.append(dict(values))
        part.request.more_tokens.append(num_tokens)
        if part.awaiting_input:
            self._next(part)
        else:
            self._leave_room(part)

    def _hold_room(self, part: PartitionRun) -> None:
        """What the piece queued next needs in the context (`room_for`, None:
        none is queued) and its turn to answer (`answer_room`), for the turn
        under way to leave it (`PartitionRun.turn_ceiling`, fixed afresh)."""
        queued = part.request.more_tokens
        part.room_for = queued[0] + TURN_MARGIN if queued else None
        part.answer_room, part.kv_ceiling = self.min_turn_tokens, None

    def _leave_room(self, part: PartitionRun) -> None:
        """Hold the turn under way to the room its next piece needs (once:
        a second piece waits for the first's turn). A decode group holding
        its loop lowers the row's cap now; else the ceiling is fixed once
        the turn's prompt is in the KV: as the row joins a group
        (`joining.join_group`), or at an item step's stop check (`stop_rules`)."""
        if part.room_for is not None:
            return
        self._hold_room(part)

        def ceiling(kv_len: int) -> int:
            held = part.turn_ceiling(self.walker.max_model_len, kv_len)
            assert held is not None  # `room_for` is set: a piece is queued
            return held

        for group in self.walker.groups.values():
            if group.hold_within(part, ceiling):
                return

    def close(self, request_id: str) -> None:
        """No more input: the request ends after the pieces it has."""
        part = self._root(request_id)
        if part is None:
            return
        part.request.input_open = False
        if part.awaiting_input and not part.request.more:
            part.awaiting_input = False
            self.walker.cursor.restart(part, len(part.plan.program))
            self.walker.finish(part, part.request.root_reason or "stop")

    # ------------------------------------------------- from the walker

    def ends_turn(self, part: PartitionRun, reason: str) -> bool:
        """Whether the loop that just ended ends a turn, not the partition."""
        run = part.request
        return (run.walk.more_input is not None and part.plan.parent is None and part.plan.stream is None
                and reason in ("stop", "length") and (run.input_open or bool(run.more)))

    def end(self, part: PartitionRun, loop: Loop, reason: str, last_token: int | None) -> None:
        """`part`'s loop ended a turn (`reason`: "stop" or "length") on
        `last_token` (None: read it from the store, a device read): cut its
        streams, then go on or wait."""
        part.request.root_reason = reason  # the input may close now: the request then ends as this turn did
        if last_token is None:
            last_token = int(self.walker.store.get(part.values[loop.value]).reshape(-1)[-1])
        part.turn_token = last_token
        part.busy = False
        part.awaiting_input = True
        self.walker.streams.end_segment(part)
        if part.request.more:
            self._next(part)
        else:
            self.on_awaiting(part.request_id, part.kv_row().kv_len + 1)  # the turn's last token, not cached yet

    def _next(self, part: PartitionRun) -> None:
        """Start the next turn: the partition's first step again, reading the
        joined piece, on the cache it has."""
        walker = self.walker
        run = part.request
        rid = part.request_id
        assert part.turn_token is not None and run.walk.more_input is not None
        assert self.join_turn is not None, "a walk taking more input on a worker given no join_turn"
        row = part.kv_row()
        try:
            run.more_tokens.pop(0)
            joined = self.join_turn(part.turn_token, run.more.pop(0), row.start)
        except Exception as e:  # a model's refusal of the piece: this request fails, not the worker
            walker.abort(rid, "error", f"{type(e).__name__}: {e}")
            return
        room = walker.max_model_len - row.kv_len - joined.num_tokens
        if room < self.min_turn_tokens:
            # the engine took the piece while the turn before it still wrote (its count of the context lags the
            # worker's): it is not spoken, and the client is told so, not left to find it missing
            walker.abort(rid, "error", f"the context ({walker.max_model_len} tokens) had {max(room, 0)} tokens left "
                                       f"to answer the next {joined.num_tokens} tokens of input, fewer than a turn "
                                       f"needs ({self.min_turn_tokens}); they were not spoken")
            return
        part.awaiting_input = False
        run.root_reason = None
        run.cut = False  # a request ends as its last turn did
        more = run.walk.more_input
        for name in [n for n in part.values if n in more or n not in run.walk.inputs]:
            walker.store.release(part.values.pop(name), rid)  # the turn's values; other inputs stay
        for name, tensor in joined.values.items():
            old = part.values.pop(name, None)
            if old is not None:  # a walk input the model's join replaced, though not one of `more_input`
                walker.store.release(old, rid)
            part.values[name] = TensorRef(walker.store.put(tensor, (rid,)))
        part.writes.clear()
        row.new_turn()  # the repetition penalty looks at this turn only, as a request of its own would
        part.turn_cap = room
        self._hold_room(part)  # for the piece queued next, if one is
        walker.cursor.restart(part, 0)
        walker.advance(part)
