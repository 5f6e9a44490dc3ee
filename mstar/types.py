"""Contracts shared across layers: requests, sampling, output chunks, and the
attention interface that components see.

Importable without torch (tensor types appear only in annotations), so the
HTTP layer and the Python client can use these dataclasses too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from mstar.errors import CONTEXT_EXCEEDED, RequestError

if TYPE_CHECKING:
    import torch

FinishReason = Literal["stop", "length", "abort", "error", "timeout"]

# Sampling bounds: beyond these a request is refused with a 400 naming the field.
MAX_TEMPERATURE = 100.0
MAX_LOGPROBS = 20  # most likely tokens reported per sampled token, as OpenAI's chat API allows
MAX_REPETITION_PENALTY = 100.0
MAX_OUTPUT_PENALTY = 2.0   # presence and frequency penalties lie in [-2, 2] (OpenAI's)
MAX_TOKEN_ID = 2**31 - 1  # top_k and token ids beyond any vocabulary; they become int64 tensors on the device


@dataclass(frozen=True)
class SamplingParams:
    """How a request's tokens are drawn and when its generation stops.

    `max_tokens` None is the model's default budget (Orpheus speaks up to
    1200 tokens) within the room the prompt leaves in the model's context,
    or all that room where the model has none (the model's prepare makes
    it a number). `temperature == 0` is greedy. `top_k <= 0` and
    `top_p == 1` disable those filters. `seed` makes a request's draws
    reproducible whatever it is batched with.
    `stop` strings are checked on the event loop, after detokenising.
    `min_tokens`: a loop's stop ids (EOS, `stop_token_ids`) are not drawn
    before it has written that many tokens, and a `stop` string counts only
    where it ends in a later token's text (vLLM's; a talker's EOS code is no
    audio, so a fixed-length spoken answer asks for this, not `ignore_eos`).
    `logprobs` k (0..MAX_LOGPROBS) reports each sampled token's log
    probability and the k most likely tokens' (`OutputChunk.logprobs`), from
    the model's raw distribution: log_softmax of the logits before the
    repetition penalty, temperature and top-k/top-p/min-p (vLLM's default),
    so the numbers do not depend on how the token was drawn.
    `presence_penalty` and `frequency_penalty` (OpenAI's and vLLM's)
    subtract from a token's logit, once it is among the tokens the request
    generated, `presence_penalty`, and `frequency_penalty` times the number
    of times it was generated; the prompt does not count (the repetition
    penalty's history does). They apply after the repetition penalty and
    before the temperature.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    skip_special_tokens: bool = True           # the text leaves special tokens out (vLLM's)
    include_stop_str_in_output: bool = False   # the text keeps the stop string that ended it (vLLM's)

    def replace(self, **changes: Any) -> SamplingParams:
        """`dataclasses.replace(self, **changes)` at a fraction of its cost
        (a request's intake makes several): the generated `__init__` only
        sets each field (there is no `__post_init__`), so a copy of the
        fields with `changes` on top is the same params. An unknown name
        goes through `dataclasses.replace`, for its TypeError."""
        if not changes.keys() <= _SAMPLING_FIELD_NAMES:
            return dataclasses.replace(self, **changes)
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__, **changes)
        return new

    @property
    def penalises_outputs(self) -> bool:
        """A presence or frequency penalty is on: the sampler counts the tokens it generates."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def validate(self, max_model_tokens: int | None = None) -> None:
        """Raise `RequestError` naming the first field out of range (or of
        the wrong type: per-key overrides arrive as plain dicts)."""
        if self.max_tokens is not None and (not _integer(self.max_tokens) or self.max_tokens < 1):
            raise RequestError("must be a positive integer", field="max_tokens")
        if max_model_tokens is not None and self.max_tokens is not None and self.max_tokens > max_model_tokens:
            raise RequestError(f"must be at most {max_model_tokens}, the model's context length (the prompt takes "
                               "its share of it too)", field="max_tokens", code=CONTEXT_EXCEEDED)
        if not _number(self.temperature) or not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise RequestError(f"must be in [0, {MAX_TEMPERATURE}]", field="temperature")
        if not _integer(self.top_k) or (self.top_k < 0 and self.top_k != -1) or self.top_k > MAX_TOKEN_ID:
            raise RequestError(f"must be in [0, {MAX_TOKEN_ID}] (or -1 to disable)", field="top_k")
        if not _number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise RequestError("must be in (0, 1]", field="top_p")
        if not _number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise RequestError("must be in [0, 1]", field="min_p")
        if not _number(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise RequestError(f"must be in (0, {MAX_REPETITION_PENALTY}]", field="repetition_penalty")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _number(value) or not -MAX_OUTPUT_PENALTY <= value <= MAX_OUTPUT_PENALTY:
                raise RequestError(f"must be in [-{MAX_OUTPUT_PENALTY:g}, {MAX_OUTPUT_PENALTY:g}]", field=name)
        if self.seed is not None and not _integer(self.seed):
            raise RequestError("must be an integer", field="seed")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            # the HTTP routes fold any int64 into the engine's range: only a seed past 64 bits gets here from them
            raise RequestError("must fit in 64 bits (the engine's own range is [0, 2**63))", field="seed")
        if any(not _integer(t) or not 0 <= t <= MAX_TOKEN_ID for t in self.stop_token_ids):
            raise RequestError(f"must be integers in [0, {MAX_TOKEN_ID}]", field="stop_token_ids")
        if any((not isinstance(s, str)) or not s for s in self.stop):
            raise RequestError("must be non-empty strings", field="stop")
        for flag in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, flag), bool):
                raise RequestError("must be a boolean", field=flag)
        if not _integer(self.min_tokens) or self.min_tokens < 0:
            raise RequestError("must be a non-negative integer", field="min_tokens")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise RequestError(f"must be at most max_tokens ({self.max_tokens})", field="min_tokens")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise RequestError(f"must be an integer in [0, {MAX_LOGPROBS}]", field="logprobs")


_SAMPLING_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(SamplingParams))


def _integer(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass
class GenerateRequest:
    """What the engine accepts. `inputs` are the walk's inputs before the
    model prepares them (for a language model: `prompt_ids`, a list of ints)."""

    request_id: str
    model: str
    inputs: dict[str, Any]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    walk: str | None = None
    more_input: bool = False   # more input follows (`Engine.append`) until `Engine.close_input`
    # sampling key (the name of a partition that samples) -> SamplingParams fields over that key's own;
    # `sampling` is the root key's, so an entry for the root overrides fields of `sampling`
    sampling_by: dict[str, dict[str, Any]] = field(default_factory=dict)
    # lower runs first among requests waiting for a step (as vLLM's `priority`); realtime sessions ask for
    # REALTIME_PRIORITY, ahead of the default
    priority: int = 0


REALTIME_PRIORITY = -1


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's log probability and the `top` most likely tokens
    (id, logprob) at its position, most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(slots=True)  # not frozen: one is built per token a step, and a frozen __init__ costs ~4x
class OutputChunk:
    """One piece of a request's output, in order. `token_ids` and `text` are
    the new tokens and text since the previous chunk; `num_output_tokens` is
    cumulative. The last chunk has `finished` set and a `finish_reason`.
    Readers take it as it is; nothing changes one once it is queued."""

    request_id: str
    token_ids: tuple[int, ...] = ()
    text: str = ""
    modality: str = "text"
    audio: bytes | None = None    # PCM16 little-endian mono at `sample_rate`
    sample_rate: int | None = None
    data: Any = None              # an emitted value of another modality, as host data
    finished: bool = False
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # a "stop" finish's stop string or stop id (vLLM's); None for EOS
    error: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    awaiting_input: bool = False  # a request taking more input has caught up with all it was given
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per token of `token_ids`, if the request asked


@dataclass(frozen=True)
class ModelCard:
    """What `/v1/models` and `/health` show of a served model."""

    name: str
    max_model_len: int
    walks: tuple[str, ...]
    default_walk: str
    devices: dict[str, tuple[str, ...]] = field(default_factory=dict)  # component -> devices
    voices: tuple[str, ...] = ()
    default_sampling: SamplingParams = field(default_factory=SamplingParams)
    input_modalities: tuple[str, ...] = ("text",)  # what its chat messages may hold
    tts_walk: str | None = None          # its walk for text to speech, if it has one
    spoken_chat_walk: str | None = None  # its walk for chat answers spoken as well as written, if it has one
    # what a request on `tts_walk` gets for the sampling fields it leaves out (the walk's root key's defaults)
    tts_sampling: SamplingParams = field(default_factory=SamplingParams)
    early_tts_walk: str | None = None    # `tts_walk` with its first audio sooner, if it has one
    written_walk: str | None = None      # what text routes run where `default_walk` speaks, if it has one
    spoken_audio_key: str | None = None  # the sampling key of a spoken chat answer's audio frames, if it speaks so
    aliases: tuple[str, ...] = ()        # more names clients may use for it (--served-model-name's later ones)
    root: str = ""                       # what it was loaded from (--model), whatever name it is served under
    # what a text request gets for the sampling fields it leaves out (the generation config's, --generation-config),
    # max_tokens aside: the budget of one that sets none is `default_sampling`'s, within the room its prompt leaves
    text_defaults: Mapping[str, float | int] = field(default_factory=dict)

    def answers_to(self, name: str) -> bool:
        return name == self.name or name in self.aliases


@dataclass(frozen=True)
class Rotary:
    """Rotary position embedding for the new tokens of a step, in the
    rotate-half layout: x * cos[p] + rotate_half(x) * sin[p].

    `cos`, `sin`: [max_positions, head_dim] float32 tables; `positions`: [T].
    An attention context applies it to q and k (fused with the KV write where
    a kernel can)."""

    cos: torch.Tensor
    sin: torch.Tensor
    positions: torch.Tensor


class AttentionContext(Protocol):
    """Attention over the paged KV cache for the rows of one step.

    `q`: [T, Hq, D], `k`, `v`: [T, Hkv, D] for the T packed new tokens of the
    step. Applies `rotary` to q and k when given, writes `k`, `v` into layer
    `layer`'s pages at the rows' new positions, then attends each query to
    its row's cached keys and to its row's new keys: those at or before it,
    or all of them when the step was planned non-causal (a block attending
    within itself, such as an image's latents). Returns [T, Hq, D]. Planned
    once per step, reused by every layer.

    A context may also split that in two, for a model that writes k and v
    itself in a fused pass (`kernels/qkv_store.py`): `kv_dest(layer, tokens,
    kv_heads, head_dim, dtype, device)` says where the step's keys and
    values go (a `KVDest`), and `attend(layer, q, scale)` attends once they
    are there. The paged contexts and the code predictor's frame cache do.
    """

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                scale: float, rotary: Rotary | None = None) -> torch.Tensor: ...


@dataclass
class TokenBatch:
    """The packed input of a step of a KV-cache component.

    Rows are packed along T: row i owns tokens [query_start[i], query_start[i+1]).
    `logits_index` [B]: the token of each row whose logits the step returns.

    A mode that declares a signature (`graph.Mode`) may get more: `positions`
    [axes, T] when its component takes positions of several axes (M-RoPE);
    `embeds[name]` = (rows [Te, ...], index [Te]): an EMBEDS input's rows and
    the packed tokens they stand for (the model puts them in place of those
    tokens' embeddings); `extra[name]`: a TENSOR input stacked over rows (a
    list when ragged); `start_positions` [B]: each row's first position when
    positions are not given (its cached tokens plus its rope delta). A
    component with per-row state gets `state`: its tensors and each row's
    slot in them, to read and update in place. A mode declared with `draws`
    gets `draw(logits [B, V], j) -> [B] int64`: its j-th token of the step,
    drawn as the runtime's sampler draws (each row's params, seed and
    counter under the step's `draws` key), so a fused mode draws what the
    unfused steps would.
    """

    input_ids: torch.Tensor        # [T] int64
    positions: torch.Tensor        # [T] int64, or [axes, T]
    query_start: torch.Tensor      # [B + 1] int64 (CPU)
    logits_index: torch.Tensor     # [B] int64
    attn: AttentionContext
    embeds: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    start_positions: torch.Tensor | None = None  # [B] int64
    state: StateRows | None = None
    draw: Callable[[torch.Tensor, int], torch.Tensor] | None = None


@dataclass
class StateRows:
    """A step's rows of a component's state: `tensors[name]` [num_slots + 1,
    ...] (the last slot is scratch), and `slots` [B] int64 on the device, row
    i's slot."""

    tensors: dict[str, torch.Tensor]
    slots: torch.Tensor
    new: list[bool] | None = None  # a plain component's rows whose slots start empty at this step (host-known)
    host: list[int] | None = None  # `slots` on the host, where the step knows them (a graph's replay does not)
