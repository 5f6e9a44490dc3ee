"""A loop's stop rules for the rows of a step: the rows' partitions and what
the step wrote in, "stop" / "length" / None per row out; and the write cap
and stop ids a row carries into a `LoopGroup`.
"""

from __future__ import annotations

import torch

from mstar.engine.worker.rows import PartitionRun
from mstar.graph import EosToken, Loop, MaxSteps, MaxTokens, Step, StopRule, TokenIn


def _rules(rule: StopRule | None) -> tuple[StopRule, ...]:
    return rule.rules() if rule is not None else ()


def write_cap(part: PartitionRun, loop: Loop) -> int | None:
    """Writes of the loop's value at which it stops ("length"); None: no cap."""
    caps = [part.sampling.max_tokens if isinstance(r, MaxTokens) else r.n
            for r in _rules(loop.until) if isinstance(r, (MaxTokens, MaxSteps))]
    if part.turn_cap is not None:
        caps.append(part.turn_cap)
    return min(caps) if caps else None


def stop_ids(part: PartitionRun, loop: Loop) -> tuple[int, ...]:
    """Token ids that stop the loop for this request ("stop")."""
    ids: tuple[int, ...] = ()
    for rule in _rules(loop.until):
        if isinstance(rule, EosToken):
            ids += part.stop_ids
        elif isinstance(rule, TokenIn) and not part.sampling.ignore_eos:
            ids += rule.ids
    return ids


def checking_loop(part: PartitionRun) -> Loop | None:
    """The loop whose stop rule judges what the current step writes."""
    node = part.node()
    if isinstance(node, Loop):
        return node
    nxt = part.plan.nodes[part.cursor + 1] if part.cursor + 1 < len(part.plan.nodes) else None
    if isinstance(nxt, Loop) and isinstance(node, Step) and nxt.value in node.outputs:
        return nxt
    return None


def stop_reasons(parts: list[PartitionRun], values: dict[str, torch.Tensor]) -> list[str | None]:
    """Device-side stop rules for every row of a step, vectorised over the
    rows where the rule is about tokens: "stop" (a stop token), "length"
    (a write cap) or None."""
    reasons: list[str | None] = [None] * len(parts)
    token_rows: list[int] = []
    token_sets: list[tuple[int, ...]] = []
    loop_value = None
    for i, part in enumerate(parts):
        loop = checking_loop(part)
        if loop is None:
            continue
        loop_value = loop.value
        cap = write_cap(part, loop)
        if cap is not None and part.writes.get(loop.value, 0) + 1 >= cap:
            reasons[i] = "length"
        ids = stop_ids(part, loop)
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
