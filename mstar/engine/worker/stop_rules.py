"""A loop's stop rules for the rows of a step: the rows' partitions and what
the step wrote in, "stop" / "length" / None per row out; and the write cap
(fixed when the loop starts, in its `Frame`) and stop ids a row carries into
a `LoopGroup`.
"""

from __future__ import annotations

from typing import Callable

import torch

from mstar.engine.worker.rows import Frame, PartitionRun
from mstar.graph import EosToken, Loop, MaxSteps, MaxTokens, StopRule, TokenIn


def _rules(rule: StopRule | None) -> tuple[StopRule, ...]:
    return rule.rules() if rule is not None else ()


def loop_key(part: PartitionRun, loop: Loop) -> str:
    """The sampling key a loop's stop rules read (`max_tokens`, stop ids): the
    key of the step of its body that writes its value."""
    return part.key(loop.writer)


def ran_out(part: PartitionRun, loop: Loop, frame: Frame) -> bool:
    """Whether the loop, stopped at its cap ("length"), stopped at its key's
    `max_tokens`: its output was cut short, not ended by a count the walk
    fixes (`MaxSteps`)."""
    budget = part.request.sampling[loop_key(part, loop)].max_tokens
    return budget is not None and frame.cap == budget and any(isinstance(r, MaxTokens) for r in _rules(loop.until))


def write_cap(part: PartitionRun, loop: Loop, read: Callable[[str], int]) -> int | None:
    """Writes of the loop's value at which it stops ("length"); None: no cap.
    `read`: the integer a walk value holds (a `MaxSteps(value=...)` cap). A
    later turn's cap (what is left of the context) binds top-level loops."""
    max_tokens = part.request.sampling[loop_key(part, loop)].max_tokens
    caps = [max_tokens if isinstance(r, MaxTokens) else r.n if r.n is not None else read(r.value)
            for r in _rules(loop.until) if isinstance(r, (MaxTokens, MaxSteps))]
    if part.turn_cap is not None and not part.loops:
        caps.append(part.turn_cap)
    return min(caps) if caps else None


def stop_ids(part: PartitionRun, loop: Loop) -> tuple[int, ...]:
    """Token ids that stop the loop for this request ("stop")."""
    key = loop_key(part, loop)
    ids: tuple[int, ...] = ()
    for rule in _rules(loop.until):
        if isinstance(rule, EosToken):
            ids += part.request.stop_ids[key]
        elif isinstance(rule, TokenIn) and not part.request.sampling[key].ignore_eos:
            ids += rule.ids
    return ids


def frame_stop_ids(part: PartitionRun, loop: Loop, frame: Frame) -> tuple[int, ...]:
    """`stop_ids` of the loop `frame` runs, read once: a request's stop ids
    and sampling do not change while it is in a loop."""
    if frame.stops is None:
        frame.stops = stop_ids(part, loop)
    return frame.stops


def banned_ids(part: PartitionRun) -> tuple[int, ...]:
    """The stop ids the step under the cursor may not draw: its loop's, while
    the loop has written fewer than its key's `min_tokens`."""
    checked = checking_loop(part)
    if checked is None:
        return ()
    loop, frame = checked
    if frame.count >= part.request.sampling[loop_key(part, loop)].min_tokens:
        return ()
    return frame_stop_ids(part, loop, frame)


def checking_loop(part: PartitionRun) -> tuple[Loop, Frame] | None:
    """The loop whose stop rule judges what the step under the cursor
    writes, and its frame."""
    ins = part.instr()
    if ins is None or ins.checks is None:
        return None
    frame = part.frame(ins.checks)
    assert frame is not None, "a step checked by a loop runs inside it"
    return part.plan.loops[ins.checks].loop, frame


def stop_reasons(parts: list[PartitionRun], values: dict[str, torch.Tensor], max_model_len: int) -> list[str | None]:
    """Device-side stop rules for every row of a step, vectorised over the
    rows where the rule is about tokens: "stop" (a stop token), "length"
    (a write cap) or None."""
    reasons: list[str | None] = [None] * len(parts)
    token_rows: list[int] = []
    token_sets: list[tuple[int, ...]] = []
    loop_value = None
    for i, part in enumerate(parts):
        if part.done:  # its request failed earlier in this step (a row alone): its outputs are dropped
            continue
        checked = checking_loop(part)
        if checked is None:
            continue
        loop, frame = checked
        loop_value = loop.value
        if frame.cap is not None and frame.count + 1 >= frame.cap or _at_ceiling(part, max_model_len):
            reasons[i] = "length"
        ids = frame_stop_ids(part, loop, frame)
        if ids:
            token_rows.append(i)
            token_sets.append(ids)
    if token_rows and loop_value is not None and loop_value in values:
        width = max(len(s) for s in token_sets)
        table = torch.full((len(token_rows), width), -1, dtype=torch.long)
        for j, s in enumerate(token_sets):
            table[j, : len(s)] = torch.tensor(s, dtype=torch.long)
        tokens = values[loop_value].reshape(len(parts), -1)[token_rows, -1].to("cpu", torch.long)
        hit = (table == tokens[:, None]).any(dim=1).tolist()
        for j, i in enumerate(token_rows):
            if hit[j]:
                reasons[i] = "stop"
    return reasons


def _at_ceiling(part: PartitionRun, max_model_len: int) -> bool:
    """A turn's top-level loop has filled the context up to the room its
    next piece of input needs (`PartitionRun.turn_ceiling`; the step that
    ran is in the KV already)."""
    if len(part.loops) != 1:
        return False
    ceiling = part.turn_ceiling(max_model_len)
    return ceiling is not None and part.kv_row().kv_len >= ceiling
