"""The talker and code2wav as the runtime steps them.

`talker.prefill`: per row, the thinker's prompt ids, its accept-layer rows
(all of the prompt's; the placeholders in user turns are taken here), the
first text token (the first item of the thinker's text stream) and the
voice's codec id in; the talker prompt's rows are built here and run over
the row's KV cache at the positions the step was given. `talker.speak`: the
frame's first code, the last hidden state and the step's text side (a thinker
token id: the next text token, tts_eos or tts_pad) in; the frame completed
by the code predictor and the next frame's first code out; `talker.read` is
`speak` with its text token taken from a script the request gave (text to
speech). They mask the codes the first code may never take (the talker's
special ids but codec_eos) before the runtime samples.

`code2wav.frame`: each row's next frames in, the samples they finish out,
from the row's state slot (a slot starts zeroed, and the runtime says which
rows' slots are new: a new utterance's first `held` samples are not audio
and are dropped).
"""

from __future__ import annotations

import dataclasses

import structlog
import torch
from torch import nn

from mstar.kernels.graph_capture import capture_buckets
from mstar.kernels.host_copy import index_on
from mstar.models.qwen3_omni.config import Qwen3OmniConfig
from mstar.models.qwen3_omni.speech.code2wav import Code2Wav
from mstar.models.qwen3_omni.speech.talker import TalkerDecoder, suppressed_codes
from mstar.models.qwen3_omni.speech.talker_prompt import talker_embeds, talker_rows
from mstar.types import StateRows, TokenBatch

FRAME_GRAPH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
log = structlog.get_logger(__name__)


def _rows(value: torch.Tensor | list[torch.Tensor]) -> list[torch.Tensor]:
    return list(value) if isinstance(value, (list, tuple)) else list(value.unbind(0))


class TalkerSteps(nn.Module):
    """Component `talker`: modes `prefill`, `speak` and `read`."""

    def __init__(self, talker: TalkerDecoder, cfg: Qwen3OmniConfig) -> None:
        super().__init__()
        self.talker, self.cfg = talker, cfg
        device = talker.codec_head.weight.device
        self.register_buffer("suppressed", suppressed_codes(cfg.talker).to(device), persistent=False)

    def prefill(self, batch: TokenBatch) -> dict[str, torch.Tensor]:
        """Every row's talker prompt at once; the prompts, first tokens and
        voices come on the host (the mode's `host` inputs), so nothing here
        waits for the device."""
        extra = batch.extra
        prompts = [p.reshape(-1).tolist() for p in _rows(extra["prompt"])]
        hiddens = _rows(extra["hidden"]) if "hidden" in extra else [None] * len(prompts)
        ctx = talker_embeds(self.talker, self.cfg, prompts, self._read_rows(prompts, hiddens),
                            torch.as_tensor(extra["first"]).reshape(-1),
                            torch.as_tensor(extra["voice"]).reshape(-1).tolist())
        index = torch.arange(ctx.shape[0], device=ctx.device)
        out = self.talker.prefill(dataclasses.replace(batch, embeds={"ctx": (ctx, index)}))
        return self._masked(out)

    def _read_rows(self, prompts: list[list[int]], hiddens: list[torch.Tensor | None]) -> torch.Tensor:
        """The accept-layer rows the talker reads ([M, Ht], prompt after
        prompt) from each row's rows of its whole prompt, in one gather; a row
        without them (a prompt without media) reads zeros."""
        device = self.talker.codec_head.weight.device
        width = self.cfg.talker.thinker_hidden_size
        parts = [torch.zeros(len(ids), width, device=device) if h is None else h for ids, h in zip(prompts, hiddens)]
        index, start = [], 0
        for ids, part in zip(prompts, parts):
            index += [start + i for i in talker_rows(ids, self.cfg.ids).nonzero().reshape(-1).tolist()]
            start += part.shape[0]
        if not index:
            return torch.zeros(0, width, device=device)
        return torch.cat([p.to(device) for p in parts]).index_select(0, index_on(index, device))

    def speak(self, batch: TokenBatch) -> dict[str, torch.Tensor]:
        text = torch.as_tensor(batch.extra["text"]).reshape(-1)
        extra = {**batch.extra, "text": self.talker.text_rows(text)}
        return self._masked(self.talker.speak(dataclasses.replace(batch, extra=extra)))

    def read(self, batch: TokenBatch) -> dict[str, torch.Tensor]:
        """`speak`, its text token the script's next (`at`: the step's round):
        then tts_eos once, then tts_pad, as after a thinker's last token."""
        return self.speak(self.as_graph_step("read", batch))

    # a mode whose steps another mode's CUDA graphs replay, once `as_graph_step` has reduced its inputs
    graph_aliases = {"read": "speak"}

    def as_graph_step(self, mode: str, batch: TokenBatch) -> TokenBatch:
        """A `read` batch as `speak` takes it: the script's next token as
        the text input (then tts_eos once, then tts_pad)."""
        if mode != "read":
            raise ValueError(f"talker mode '{mode}' is no other mode's step")
        ids = self.cfg.ids
        scripts = [t.reshape(-1) for t in _rows(batch.extra["script"])]
        flat = torch.cat(scripts)
        # on the scripts' device, nothing read back: lengths are shapes, the rounds stay where they are
        n = torch.tensor([t.numel() for t in scripts]).to(flat.device)
        k = torch.as_tensor(batch.extra["at"]).reshape(-1).to(flat.device) + 1
        token = flat[n.cumsum(0) - n + torch.minimum(k, n - 1)]
        text = torch.where(k < n, token, torch.where(k == n, ids.tts_eos, ids.tts_pad))
        return dataclasses.replace(batch, extra={"last": batch.extra["last"], "text": text})

    def _masked(self, out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out["logits"] = out["logits"].index_fill(-1, self.suppressed, float("-inf"))
        return out


class Code2WavSteps(nn.Module):
    """Component `code2wav`: mode `frame`, with per-row state. On CUDA a step
    of one frame a row replays a graph of its batch bucket, captured at the
    first step (when the state's tensors exist) through the runtime's capture
    (one worker at a time, thread-local); the bucket's spare rows work in the
    state pool's scratch slot. `enforce_eager` (set by the runtime from
    `--enforce-eager`) keeps it eager, as does a capture that failed."""

    def __init__(self, code2wav: Code2Wav) -> None:
        super().__init__()
        self.code2wav = code2wav
        self.enforce_eager = False
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._static: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # codes, slots, fresh

    def frame(self, codes: torch.Tensor, state: StateRows) -> dict[str, list[torch.Tensor]]:
        """codes [B, k, G]: k frames a row (the stream's items) -> the rows'
        samples: [B, S], or a list of rows when a row's first frame is among
        them (its first samples, from before its start, are cut)."""
        frames = codes.reshape(codes.shape[0], -1, codes.shape[-1]).transpose(1, 2).long()  # [B, Q, k]
        # a row's first frame: known on the host when the runtime says so (no read back, which would sync)
        new = state.new if state.new is not None else (state.tensors["frames"][state.slots] == 0).tolist()
        fresh = torch.tensor(new, dtype=torch.bool)
        if frames.is_cuda:  # pinned: a copy from pageable memory waits for the stream, the last frame's step included
            fresh = fresh.pin_memory()
        fresh = fresh.to(frames.device, non_blocking=True)
        rows = frames.shape[0]
        zeroed = state.new is not None  # the runtime zeroes a slot when it hands it out: new rows need no masking
        if (zeroed and frames.is_cuda and frames.shape[-1] == 1 and rows <= FRAME_GRAPH_BUCKETS[-1]
                and self._graphed(frames, state)):
            pcm = self._replay(frames, state, fresh)
        else:
            pcm = self.code2wav.stream(frames, state, fresh, zeroed)
        if not any(new):  # one [B, S] tensor: its emit is one copy to the host and one PCM conversion
            return {"pcm": pcm}
        held = self.code2wav.held
        return {"pcm": [p[held:] if first else p for p, first in zip(pcm, new)]}

    def _graphed(self, frames: torch.Tensor, state: StateRows) -> bool:
        if self.enforce_eager:
            return False
        if self._static is None:
            try:
                self._capture(frames.shape[1], state)
            except Exception:  # noqa: BLE001 - a capture that fails leaves code2wav eager, not broken
                log.exception("code2wav CUDA graphs not captured; running eagerly")
                self.enforce_eager = True
                return False
        return True

    def _replay(self, frames: torch.Tensor, state: StateRows, fresh: torch.Tensor) -> torch.Tensor:
        assert self._static is not None
        codes, slots, new = self._static
        rows = frames.shape[0]
        bucket = next(b for b in FRAME_GRAPH_BUCKETS if b >= rows)
        scratch = next(iter(state.tensors.values())).shape[0] - 1
        slots.fill_(scratch)
        new.fill_(True)
        codes[:rows] = frames
        slots[:rows] = state.slots
        new[:rows] = fresh
        graph, out = self._graphs[bucket]
        graph.replay()
        return out[:rows].clone()  # out of the static buffer, in stream order: the next replay rewrites it

    def _capture(self, quantizers: int, state: StateRows) -> None:
        """Every bucket's graph of one frame a row, over the pool's tensors."""
        top, device = FRAME_GRAPH_BUCKETS[-1], state.slots.device
        scratch = next(iter(state.tensors.values())).shape[0] - 1
        codes = torch.zeros(top, quantizers, 1, dtype=torch.long, device=device)
        slots = torch.full((top,), scratch, dtype=torch.long, device=device)
        fresh = torch.ones(top, dtype=torch.bool, device=device)
        graphs = capture_buckets(
            device, FRAME_GRAPH_BUCKETS, lambda b: StateRows(state.tensors, slots[:b]),
            lambda b, rows: self.code2wav.stream(codes[:b], rows, fresh[:b], zeroed=True), "capturing code2wav graphs",
            show_progress=False)
        self._graphs = graphs
        self._static = (codes, slots, fresh)
