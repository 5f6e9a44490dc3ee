"""The toy omni model (`toys/omni.py`) served on the CPU: an encoder's rows
spliced into an M-RoPE thinker's prompt; the thinker's hidden state of every
step streamed item by item into a talker partition with its own KV cache,
sampling key and positions; its codes streamed with left context into a
codec. Concurrent requests of different lengths, seeds and talker sampling,
on one worker and with the talker and codec on a second, against the same
modules run unbatched in plain loops over dense caches: tokens and codes
identical, samples within 1e-5. Also with audio appended while requests run:
each piece a thinker turn on its cache, the talker restarted on its own; and
frames of a code predictor, nested in the talker's loop (`chat_frames`) or
fused into its step and drawing through `TokenBatch.draw` (`chat_fused`)."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import pytest
import torch

from mstar.config import EngineConfig, SchedulerConfig
from mstar.engine.engine import Engine
from mstar.engine.messages import Forward, Submit
from mstar.errors import RequestError
from mstar.models.prepared import key_seed
from mstar.placement import parse_spec
from mstar.types import GenerateRequest, SamplingParams, TokenBatch
from toys.audio_decoder import HIDDEN, MEL, PLACEHOLDER, VOCAB, mrope_positions
from toys.serving import DEVICES, drained
from toys.dense import DenseAttention, draw
from toys.omni import CHUNK, GROUPS, LEFT, ToyOmniModel

TOL = 1e-5


@dataclasses.dataclass
class Expected:
    text: list[int]
    codes: list[int]
    pcm: list[torch.Tensor]


class Reference:
    """One request at a time, turn after turn: the thinker to its cap, then
    the talker over the turn's items (a pass of its own, on its cache), then
    the codec over the pass's codes in chunks. Caches and draw counters go
    on from turn to turn."""

    def __init__(self, model: ToyOmniModel) -> None:
        self.model = model
        self.attn, self.tattn = DenseAttention(), DenseAttention()
        self.drawn = self.talked = 0     # draws so far: the thinker's, the talker's
        self.last: int | None = None     # the last turn's last token, not fed back yet
        self.start = 0                   # its position
        self.talker_len = 0              # tokens in the talker's cache

    @torch.inference_mode()
    def turn(self, ids: list[int], mel: torch.Tensor, think: SamplingParams, talk: SamplingParams) -> Expected:
        m = self.model
        assert think.seed is not None
        if self.last is not None:
            ids = [self.last, *ids]
        audio = m.encoder.encode([mel])["emb"][0]
        at = torch.tensor([i for i, t in enumerate(ids) if t == PLACEHOLDER], dtype=torch.long)
        n, pos = len(ids), mrope_positions(ids) + self.start
        out = m.thinker.prefill(TokenBatch(
            input_ids=torch.tensor(ids), positions=pos, query_start=torch.tensor([0, n]),
            logits_index=torch.tensor([n - 1]), attn=self.attn, embeds={"audio": (audio, at)}))
        text = [draw(out["logits"][0], think, think.seed, self.drawn)]
        prompt_hidden, items = out["hidden"], [out["last"][0]]
        following = int(pos.max()) + 1
        for k in range(1, think.max_tokens):
            out = m.thinker.decode(TokenBatch(
                input_ids=torch.tensor([text[-1]]), positions=torch.full((3, 1), following + k - 1),
                query_start=torch.tensor([0, 1]), logits_index=torch.tensor([0]), attn=self.attn))
            items.append(out["hidden"][0])
            text.append(draw(out["logits"][0], think, think.seed, self.drawn + k))
        self.drawn += len(text)
        self.last, self.start = text[-1], following + len(text) - 1
        self.items, self.prompt_hidden = items, prompt_hidden

        seed, t, base = key_seed(think.seed, "talker"), prompt_hidden.shape[0], self.talker_len
        out = m.talker.prefill(TokenBatch(
            input_ids=torch.zeros(t, dtype=torch.long), positions=torch.arange(base, base + t),
            query_start=torch.tensor([0, t]), logits_index=torch.tensor([t - 1]), attn=self.tattn,
            embeds={"ctx": (prompt_hidden, torch.arange(t))}))
        codes = [draw(out["logits"][0], talk, seed, self.talked)]
        for k, item in enumerate(items):  # one talker step per thinker item, until its own cap
            if len(codes) >= talk.max_tokens:
                break
            out = m.talker.decode(TokenBatch(
                input_ids=torch.tensor([codes[-1]]), positions=torch.tensor([base + t + k]),
                query_start=torch.tensor([0, 1]), logits_index=torch.tensor([0]), attn=self.tattn,
                extra={"h": item.reshape(1, 1, HIDDEN)}))
            codes.append(draw(out["logits"][0], talk, seed, self.talked + k + 1))
        self.talked += len(codes)
        self.talker_len = base + t + len(codes) - 1  # the pass's last code is never fed back

        pcm = []
        for i in range((len(codes) + CHUNK - 1) // CHUNK):
            span = codes[max(0, i * CHUNK - LEFT):(i + 1) * CHUNK]
            pcm.append(m.codec.chunk(torch.tensor([span]), torch.tensor([i]))["pcm"][0])
        return Expected(text, codes, pcm)


def reference(model: ToyOmniModel, ids: list[int], mel: torch.Tensor, think: SamplingParams,
              talk: SamplingParams) -> Expected:
    return Reference(model).turn(ids, mel, think, talk)


# (text before, audio rows, text after, thinker max_tokens, temperature, talker max_tokens, talker temperature)
CASES = [(3, 5, 2, 6, 0.0, 20, 0.8), (1, 2, 6, 4, 0.9, 3, 0.0), (5, 0, 4, 9, 0.7, 20, 1.1),
         (2, 7, 1, 5, 0.0, 6, 0.5), (4, 3, 3, 8, 1.2, 7, 0.9), (2, 1, 2, 1, 0.6, 20, 0.7)]


def _requests(seed: int) -> list[tuple[list[int], torch.Tensor, SamplingParams, SamplingParams]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i, (before, audio, after, max_tokens, temperature, talk_max, talk_temp) in enumerate(CASES):
        def text(n: int) -> list[int]:
            return torch.randint(PLACEHOLDER + 1, VOCAB, (n,), generator=gen).tolist()
        ids = text(before) + [PLACEHOLDER] * audio + text(after)
        mel = torch.randn(audio, MEL, generator=gen)
        think = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=500 + i)
        talk = SamplingParams(max_tokens=talk_max, temperature=talk_temp, top_k=8)
        out.append((ids, mel, think, talk))
    return out


Served = tuple[list[int], list[int], list[list[float]], str | None]  # text, codes, pcm chunks, finish reason


async def _serve(eng: Engine, rid: str, turns: list[tuple[list[int], torch.Tensor]], think: SamplingParams,
                 talk: SamplingParams, cp: SamplingParams | None = None, walk: str = "chat") -> Served:
    """One request: its first turn's audio, then (with more turns) each later
    one appended once the request has caught up with the one before, then
    its input closed."""
    by = {"talker": {"max_tokens": talk.max_tokens, "temperature": talk.temperature, "top_k": talk.top_k}}
    if cp is not None:
        by["cp"] = {"temperature": cp.temperature, "top_k": cp.top_k}
    ids, mel = turns[0]
    request = GenerateRequest(rid, "toy-omni", {"prompt_ids": ids, "mel": mel}, think, sampling_by=by, walk=walk,
                              more_input=len(turns) > 1)
    text, codes, pcm, reason, sent = [], [], [], None, 1
    async for chunk in eng.submit(request):
        text.extend(chunk.token_ids)
        if chunk.data is not None:
            data = chunk.data.tolist() if hasattr(chunk.data, "tolist") else chunk.data
            (pcm if isinstance(data, list) else codes).append(data)
        if chunk.awaiting_input:
            if sent < len(turns):
                more_ids, more_mel = turns[sent]
                eng.append(rid, {"prompt_ids": more_ids, "mel": more_mel})
                sent += 1
            else:
                eng.close_input(rid)
        if chunk.finished:
            reason = chunk.finish_reason
    return text, codes, pcm, reason


def _check(got: Served, want: list[Expected]) -> None:
    """What a request got against what its turns give one at a time."""
    text, codes, pcm, reason = got
    want_pcm = [p for e in want for p in e.pcm]
    # every part is compared before any fails: which of them went wrong together tells where a fault lies
    wrong = {"reason": (reason, "length"), "text": (text, [t for e in want for t in e.text]),
             "codes": (codes, [c for e in want for c in e.codes]),
             "pcm chunks": ([len(c) for c in pcm], [len(r) for r in want_pcm])}
    wrong = {k: v for k, v in wrong.items() if v[0] != v[1]}
    if "pcm chunks" not in wrong:
        far = [i for i, (chunk, ref) in enumerate(zip(pcm, want_pcm))
               if not torch.allclose(torch.tensor(chunk), ref, atol=TOL, rtol=0)]
        if far:
            wrong["pcm chunks beyond the tolerance"] = (far, [])
    assert not wrong, wrong


SETUPS = [(("cpu",), "replicas"), (("cpu:0", "cpu:1"), "enc=0,thinker=0,talker=1,codec=1")]
ON_CUDA = pytest.param(("cuda:0",), "replicas", marks=DEVICES[1].marks, id="cuda")


@pytest.mark.parametrize("devices, placement", SETUPS)
async def test_toy_omni_matches_its_unbatched_reference(devices: tuple[str, ...], placement: str) -> None:
    model = ToyOmniModel()
    requests = _requests(3)
    expected = [reference(model, ids, mel, think, talk) for ids, mel, think, talk in requests]
    gate = threading.Event()
    model.encoder.gate = gate  # the first encode holds its worker: the other requests queue, and share steps
    eng = Engine(EngineConfig(model="toy-omni", devices=devices, placement=parse_spec(placement)), model=model)
    await eng.start()
    try:
        runs = [asyncio.ensure_future(_serve(eng, f"o{i}", [(ids, mel)], think, talk))
                for i, (ids, mel, think, talk) in enumerate(requests)]
        await asyncio.sleep(0.2)
        gate.set()
        for got, want in zip(await asyncio.gather(*runs), expected):
            _check(got, [want])
        assert any(w.stats.rows > w.stats.steps for w in eng.workers)  # rows did share steps
        # the thinker decoded in a group that kept each step's hidden state for the talker's stream
        assert any(g.extras == {"hidden": "h"} for w in eng.workers for g in w.walker.groups.values())
        await drained(eng)
    finally:
        await eng.shutdown()


@pytest.mark.parametrize("devices, placement", SETUPS)
async def test_audio_appended_runs_a_thinker_turn_and_restarts_the_talker(devices: tuple[str, ...],
                                                                          placement: str) -> None:
    model = ToyOmniModel()
    requests = _requests(9)
    conversations = []  # per request: its turns, sampling, and what the reference gives over them
    for k, (ids, mel, think, talk) in enumerate(requests[:4]):
        more = [(ids_, mel_) for ids_, mel_, _, _ in requests[k + 1:k + 1 + (1 + k % 2)]]
        turns = [(ids, mel), *more]
        ref = Reference(model)
        expected = [ref.turn(i, m, think, talk) for i, m in turns]
        conversations.append((turns, think, talk, expected))
    eng = Engine(EngineConfig(model="toy-omni", devices=devices, placement=parse_spec(placement)), model=model)
    await eng.start()
    try:
        results = await asyncio.gather(*(_serve(eng, f"c{k}", turns, think, talk)
                                         for k, (turns, think, talk, _) in enumerate(conversations)))
        for got, (_, _, _, expected) in zip(results, conversations):
            _check(got, expected)
        await drained(eng)
    finally:
        await eng.shutdown()


@pytest.mark.parametrize("reservation, pages", [("lazy", 34), ("auto", 34), ("auto", 40)])
async def test_conversations_in_a_small_pool_go_on(reservation: str, pages: int) -> None:
    """Conversations of two and three turns in a pool too small for all of
    them: a turn's rows hold the turns before it and ask for more, so with
    auto (the default) they take pages as they go and may be swapped out
    like lazy ones, never waiting on each other for good."""
    model = ToyOmniModel()
    requests = _requests(9)
    conversations = []
    for k, (ids, mel, think, talk) in enumerate(requests[:4]):
        turns = [(ids, mel), *[(i, m) for i, m, _, _ in requests[k + 1:k + 3]]]
        ref = Reference(model)
        conversations.append((turns, think, talk, [ref.turn(i, m, think, talk) for i, m in turns]))
    eng = Engine(EngineConfig(model="toy-omni", devices=("cpu",), scheduler=SchedulerConfig(
        page_size=4, num_pages=pages, kv_reservation=reservation)), model=model)
    await eng.start()
    try:
        results = await asyncio.wait_for(asyncio.gather(*(_serve(eng, f"c{k}", turns, think, talk)
                                                          for k, (turns, think, talk, _) in enumerate(conversations))),
                                         60)
        for got, (_, _, _, expected) in zip(results, conversations):
            _check(got, expected)
        await drained(eng)
    finally:
        await eng.shutdown()


@torch.inference_mode()
def frames_reference(model: ToyOmniModel, ids: list[int], mel: torch.Tensor, think: SamplingParams,
                     talk: SamplingParams, cp: SamplingParams, fused: bool = False) -> Expected:
    """`chat_frames` one request at a time: the thinker as in `chat`; then per
    talker step a frame, its first code the talker's and the others the code
    predictor's (a cache of its own, fresh every frame), the next talker step
    reading the frame and one thinker item; frames through the codec. With
    `fused`, `chat_fused`: the same, but for the frame begun when the thinker
    is done, which its step never completes."""
    assert think.seed is not None
    ref = Reference(model)
    text = ref.turn(ids, mel, think, SamplingParams(max_tokens=1, temperature=0.0)).text  # the thinker's part
    items, prompt_hidden = ref.items, ref.prompt_hidden
    m, tattn, t = model, DenseAttention(), prompt_hidden.shape[0]
    talk_seed, cp_seed = key_seed(think.seed, "talker"), key_seed(think.seed, "cp")
    out = m.talker.prefill(TokenBatch(
        input_ids=torch.zeros(t, dtype=torch.long), positions=torch.arange(t), query_start=torch.tensor([0, t]),
        logits_index=torch.tensor([t - 1]), attn=tattn, embeds={"ctx": (prompt_hidden, torch.arange(t))}))
    code0s, last, cp_drawn, frames = [draw(out["logits"][0], talk, talk_seed, 0)], out["last"][0], 0, []
    while len(code0s) < talk.max_tokens:
        cattn = DenseAttention()
        out = m.cp.prefill(TokenBatch(
            input_ids=torch.tensor([code0s[-1]]), positions=torch.tensor([0]), query_start=torch.tensor([0, 1]),
            logits_index=torch.tensor([0]), attn=cattn, extra={"h": last.reshape(1, 1, HIDDEN)}))
        frame = [code0s[-1], draw(out["logits"][0], cp, cp_seed, cp_drawn)]
        for j in range(GROUPS - 2):
            out = m.cp.decode(TokenBatch(
                input_ids=torch.tensor([frame[-1]]), positions=torch.tensor([j + 1]),
                query_start=torch.tensor([0, 1]), logits_index=torch.tensor([0]), attn=cattn,
                extra={"j": torch.tensor([j])}))
            frame.append(draw(out["logits"][0], cp, cp_seed, cp_drawn + j + 1))
        cp_drawn += GROUPS - 1
        k = len(code0s) - 1
        if k == len(items):  # the talker's next read finds the thinker done
            if not fused:  # a fused step reads the item before it completes the frame
                frames.append(frame)
            break
        frames.append(frame)
        out = m.talker.frame(TokenBatch(
            input_ids=torch.tensor([code0s[-1]]), positions=torch.tensor([t + k]), query_start=torch.tensor([0, 1]),
            logits_index=torch.tensor([0]), attn=tattn,
            extra={"frame": torch.tensor([frame]), "h": items[k].reshape(1, 1, HIDDEN)}))
        code0s.append(draw(out["logits"][0], talk, talk_seed, k + 1))
        last = out["last"][0]
    pcm = []
    for i in range((len(frames) + CHUNK - 1) // CHUNK):
        span = frames[max(0, i * CHUNK - LEFT):(i + 1) * CHUNK]
        pcm.append(m.codec.chunk(torch.tensor([span]), torch.tensor([i]))["pcm"][0])
    return Expected(text, code0s, pcm)


def _frame_requests() -> list[tuple[list[int], torch.Tensor, SamplingParams, SamplingParams, SamplingParams]]:
    """`_requests(5)`, each with the code predictor's sampling (its seed the
    request's, derived for the "cp" key)."""
    cps = [SamplingParams(temperature=t, top_k=k) for t, k in ((0.9, 6), (0.0, 1), (1.3, 12), (0.7, 3), (1.0, 0),
                                                               (0.5, 4))]
    return [(ids, mel, think, talk, cp) for (ids, mel, think, talk), cp in zip(_requests(5), cps)]


@pytest.mark.parametrize("devices, placement", [*SETUPS, ON_CUDA])
async def test_frames_from_a_code_predictor_nested_in_the_talker(devices: tuple[str, ...], placement: str) -> None:
    model = ToyOmniModel()
    seeded = _frame_requests()
    expected = [frames_reference(model, ids, mel, think, talk, cp) for ids, mel, think, talk, cp in seeded]
    eng = Engine(EngineConfig(model="toy-omni", devices=devices, placement=parse_spec(placement), dtype="float32"),
                 model=model)
    await eng.start()
    try:
        results = await asyncio.gather(*(_serve(eng, f"f{k}", [(ids, mel)], think, talk, cp, walk="chat_frames")
                                         for k, (ids, mel, think, talk, cp) in enumerate(seeded)))
        for got, want in zip(results, expected):
            _check(got, [want])
        await drained(eng)
    finally:
        await eng.shutdown()


@pytest.mark.parametrize("devices, placement", [*SETUPS, ON_CUDA])
async def test_a_code_predictor_fused_into_the_talkers_step_draws_the_same_frames(devices: tuple[str, ...],
                                                                                    placement: str) -> None:
    """`chat_fused` runs one talker step a frame, its code predictor inside
    drawing through `TokenBatch.draw` under the "cp" key: each frame is what
    the nested loop of `chat_frames` draws, with the same seeds and
    overrides."""
    model = ToyOmniModel()
    seeded = _frame_requests()
    expected = [frames_reference(model, *r, fused=True) for r in seeded]
    eng = Engine(EngineConfig(model="toy-omni", devices=devices, placement=parse_spec(placement), dtype="float32"),
                 model=model)
    await eng.start()
    cp_steps = []
    for w in eng.workers:
        if "cp" in w.runners:
            w.runners["cp"].compute = lambda batch, inputs: cp_steps.append(batch)  # type: ignore[method-assign]
    try:
        results = await asyncio.gather(*(_serve(eng, f"u{k}", [(ids, mel)], think, talk, cp, walk="chat_fused")
                                         for k, (ids, mel, think, talk, cp) in enumerate(seeded)))
        for got, want in zip(results, expected):
            _check(got, [want])
        assert not cp_steps  # the code predictor ran inside the talker's steps only
        await drained(eng)
    finally:
        await eng.shutdown()


async def test_frames_under_preemption_speak_the_same() -> None:
    """`chat_frames` in a pool far too small, and every code predictor's row
    swapped out while idle before its next frame, as `Preemption.unstick`
    may choose (pages of one token: it swapped out two, while the step that
    restarts its cache asks for one): it comes back whole and the frames are
    the reference's."""
    model = ToyOmniModel()
    model.context = 48
    cps = [SamplingParams(temperature=0.9, top_k=6), SamplingParams(temperature=0.0)] * 3
    seeded = [(ids, mel, think, talk, cp) for (ids, mel, think, talk), cp in zip(_requests(5) + _requests(6), cps)]
    expected = [frames_reference(model, *r) for r in seeded]
    eng = Engine(EngineConfig(model="toy-omni", devices=("cpu",), scheduler=SchedulerConfig(
        page_size=1, num_pages=48, kv_reservation="lazy")), model=model)
    await eng.start()
    worker = eng.workers[0]
    enqueue, idle_swaps = worker.walker.enqueue, []

    def swap_idle_cp_rows(part, step, inputs, branch="main", **kw):  # on the worker thread, as its walker runs
        row = part.rows.get(("cp", branch))
        if step.component == "cp" and step.mode == "prefill" and row is not None and row.pages:
            worker.preemption._swap_waiting(worker.scheduler, "cp", row, None)
            idle_swaps.append(part.request_id)
        enqueue(part, step, inputs, branch, **kw)

    worker.walker.enqueue = swap_idle_cp_rows
    try:
        results = await asyncio.wait_for(asyncio.gather(*(
            _serve(eng, f"q{k}", [(ids, mel)], think, talk, cp, walk="chat_frames")
            for k, (ids, mel, think, talk, cp) in enumerate(seeded))), 120)
        for got, want in zip(results, expected):
            _check(got, [want])
        assert idle_swaps and worker.preemption.resumed >= len(idle_swaps)
        await drained(eng)
    finally:
        await eng.shutdown()


def test_in_mode_draws_have_a_sampling_key_without_repetition_penalty() -> None:
    """The "cp" key of `chat_fused` exists only through its step's `draws`:
    a request may override it, but not with a repetition penalty, which
    draws inside a step do not keep."""
    model = ToyOmniModel()
    (ids, mel, think, _), = _requests(5)[:1]
    request = GenerateRequest("r", "toy-omni", {"prompt_ids": ids, "mel": mel}, think, walk="chat_fused",
                              sampling_by={"cp": {"temperature": 0.3}})
    assert model.prepare(request).sampling["cp"].temperature == 0.3
    with pytest.raises(RequestError) as refused:
        model.prepare(dataclasses.replace(request, sampling_by={"cp": {"repetition_penalty": 1.3}}))
    assert refused.value.field == "sampling_by.cp.repetition_penalty"


async def test_rows_swapped_out_and_back_speak_the_same() -> None:
    """Lazy pages in a pool that holds one request at its longest: thinker
    rows (a decode group keeping hidden states for the talkers) are swapped
    out and resumed, and so are talker rows (step by step) when every row
    waits for pages and none can move on; every request still gets the
    reference's text, codes and samples."""
    model = ToyOmniModel()
    model.context = 48
    requests = _requests(3) + _requests(4)
    expected = [reference(model, ids, mel, think, talk) for ids, mel, think, talk in requests]
    swapped: dict[str, int] = {"thinker": 0, "talker": 0}
    # which rows wait for pages first is up to the worker's pace against the submissions: a loaded machine may
    # need another run before both kinds have been swapped; every run must give the reference's outputs
    for _ in range(4):
        eng = Engine(EngineConfig(model="toy-omni", devices=("cpu",), scheduler=SchedulerConfig(
            page_size=4, num_pages=12, kv_reservation="lazy")), model=model)
        await eng.start()
        try:
            results = await asyncio.wait_for(asyncio.gather(*(
                _serve(eng, f"z{i}", [(ids, mel)], think, talk)
                for i, (ids, mel, think, talk) in enumerate(requests))), 120)
            for got, want in zip(results, expected):
                _check(got, [want])
            for kind in swapped:
                swapped[kind] += eng.workers[0].preemption.preempted_by[kind]
            await drained(eng)
        finally:
            await eng.shutdown()
        if swapped["thinker"] and swapped["talker"]:
            break
    assert swapped["thinker"] >= 1 and swapped["talker"] >= 1, swapped


async def test_a_stream_reaching_a_worker_before_its_submit_is_not_lost() -> None:
    """The root's worker may run a request's first steps and forward its
    stream start to the talker's worker before the event loop has put that
    worker's `Submit` in its inbox (the event loop stalled between the two
    sends): here the event loop is held there until the forward has gone.
    The talker's partition must still start, and speak what it should."""
    model = ToyOmniModel()
    (ids, mel, think, talk, cp), = _frame_requests()[2:3]
    want = frames_reference(model, ids, mel, think, talk, cp)
    eng = Engine(EngineConfig(model="toy-omni", devices=("cpu:0", "cpu:1"),
                              placement=parse_spec("enc=0,thinker=0,talker=1,codec=1"), dtype="float32"), model=model)
    await eng.start()
    root, talker = eng.workers
    root_submitted, forwarded = threading.Event(), threading.Event()
    send_root, send_talker = root.send, talker.send

    def to_root(msg: object) -> None:
        send_root(msg)
        if isinstance(msg, Submit):
            root_submitted.set()

    def to_talker(msg: object) -> None:
        if isinstance(msg, Submit) and root_submitted.is_set():
            forwarded.wait(10)  # the event loop stalls here while the root's worker runs ahead
        send_talker(msg)
        if isinstance(msg, Forward):
            forwarded.set()

    root.send, talker.send = to_root, to_talker  # type: ignore[method-assign]
    try:
        got = await asyncio.wait_for(_serve(eng, "late", [(ids, mel)], think, talk, cp, walk="chat_frames"), 30)
        _check(got, [want])
        await drained(eng)
    finally:
        await eng.shutdown()
