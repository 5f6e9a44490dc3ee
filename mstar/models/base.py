"""The contract between a model file and the runtime.

A `Model` declares its components and walks, builds each component's module
on a device, and turns a request into what the walk starts from (`prepare`:
a `Prepared` of values, sampling per key, stop ids and the prompt's size).
It knows nothing of scheduling, batching, threads or HTTP.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from mstar.errors import ConfigError, RequestError
from mstar.graph import Component, Emit, EosToken, HostStop, Loop, MaxTokens, Step, Walk, WalkPlan, compile_walk
from mstar.models.prepared import Prepared, PreparedPiece, fit_context, resolve_sampling, stop_ids

if TYPE_CHECKING:
    import torch
    from torch import nn

    from mstar.models.tokenizer import Tokenizer
    from mstar.types import GenerateRequest, SamplingParams


@dataclass(frozen=True)
class KVSpec:
    """Shape of one KV-cache component's pages (per layer: K and V of
    [num_pages, page_size, num_kv_heads, head_dim]).

    `token_rows`: outputs of every prompt token (a mode's HIDDEN rows="all"
    outputs, by name and width) that the pages keep beside K and V while the
    prefix cache is on, so that a prompt starting from cached pages still
    hands every token's row on (a thinker's states for its talker)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_q_heads: int = 0   # the query heads attending over these pages (0: unknown)
    token_rows: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class RowShape:
    """One row's input of a plain mode, for CUDA graphs captured at batch
    buckets: shape without the batch dimension, and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class StateSpec:
    """A component's state per row (`Component(state=True)`): named tensors,
    each of `shape` and `dtype`, that its steps read and update in place."""

    tensors: tuple[tuple[str, tuple[int, ...], torch.dtype], ...]


def text_walk(component: str) -> Walk:
    """A language model's walk: prefill the prompt, then decode token by
    token until EOS, the token budget or a stop string, streaming text."""
    return Walk(
        Step(component, "prefill", "prompt_ids", "token"),
        Loop(Step(component, "decode", "token", "token"), until=EosToken() | MaxTokens() | HostStop()),
        Emit("token", modality="text"),
        inputs=("prompt_ids",),
    )


class Model:
    """Base of every model file. Subclasses set the class attributes and
    implement `build_component` and `prepare_inputs`."""

    components: dict[str, Component] = {}
    walks: dict[str, Walk] = {}
    default_walk: str = ""
    voices: tuple[str, ...] = ()  # speaker names, for models that speak: the default (a request naming none) first
    # what a request's chat messages may hold ("text", "audio", "image"); the HTTP layer refuses the rest
    input_modalities: tuple[str, ...] = ("text",)
    # the walks that serve the APIs with audio out (None: the model serves none):
    tts_walk: str | None = None          # `{"text", "voice"}` in, audio out (`/v1/audio/speech`)
    early_tts_walk: str | None = None    # the same, its first audio sooner and less exact (`early_audio`)
    spoken_chat_walk: str | None = None  # chat `messages` and a `voice` in, text and audio out
    # the sampling key whose tokens are a spoken chat answer's audio (its frames): a request's `max_tokens` caps them
    spoken_audio_key: str | None = None
    written_walk: str | None = None      # what text routes run where the default walk speaks (its ids as text)
    # whether the served folder's generation_config.json sampling applies (a model file that publishes its own
    # root defaults, Orpheus's for speech, keeps them), and that sampling: `registry.load_model` sets it
    takes_generation_config: bool = True
    generation_defaults: Mapping[str, float | int] = MappingProxyType({})

    def __init__(self, name: str) -> None:
        self.name = name

    # -- what the runtime reads
    @property
    def tokenizer(self) -> Tokenizer | None:
        return None

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return ()

    def eos_ids(self, key: str) -> tuple[int, ...]:
        """The ids that end the token loops sampled under sampling key `key`
        unless the request sets `ignore_eos` for it: `eos_token_ids`, the
        text's, unless the key draws from another vocabulary (a talker's
        codec, say)."""
        return self.eos_token_ids

    @property
    def max_model_len(self) -> int:
        raise NotImplementedError

    @property
    def random_weights(self) -> bool:
        """Whether the weights are random (no checkpoint): such a model talks nonsense."""
        return False

    @property
    def min_turn_tokens(self) -> int:
        """The fewest tokens a turn of a request that takes more input must
        be able to write to answer at all (a speech model's first window of
        audio): a piece of input that would leave less is refused."""
        return 1

    @property
    def text_defaults(self) -> Mapping[str, float | int]:
        """What text routes give a request for the sampling fields it leaves
        out, its budget aside: that is `default_sampling`'s `max_tokens`, a
        ceiling within the room its prompt leaves, not a demand."""
        return {k: v for k, v in self.generation_defaults.items() if k != "max_tokens"}

    def walk_for(self, request: GenerateRequest) -> str:
        """The walk `request` runs: the one it names, else the default (a
        model may refine the name by what the inputs hold: the encoders a
        prompt's media need, say)."""
        return request.walk or self.default_walk

    def default_sampling(self, key: str | None = None) -> SamplingParams:
        """What a request gets for the sampling fields it leaves out (a speech
        model's published defaults, say): of the root partition (`key` None;
        callers merge these under the request's own `sampling`), or of the
        partition that samples under sampling key `key`. A `max_tokens` here
        is the key's budget where a request leaves it None, within the
        room its prompt leaves; None (this default) is all of that room.
        Here: the API's defaults, with the served folder's generation config
        on top (`generation_defaults`)."""
        from mstar.types import SamplingParams

        return SamplingParams(max_tokens=None).replace(**self.generation_defaults)

    def state_spec(self, component: str) -> StateSpec:
        """The per-row state of a component declared with `state=True`."""
        raise NotImplementedError(f"model '{self.name}' declares no state for '{component}'")

    def kv_spec(self, component: str) -> KVSpec:
        raise NotImplementedError(f"component '{component}' has no KV cache")

    def audio_logits(self, component: str) -> tuple[int, int] | None:
        """The ids [first, end) a sampled component's speech walks draw from,
        where the rest of its vocabulary is text: under `--audio-logits-only`
        its head computes only these (`VocabHead.restrict`: both ends aligned
        to its rows, or `end` the vocabulary's end). None: no such window."""
        return None

    def audio_only_walks(self) -> tuple[str, ...]:
        """The walks served under `--audio-logits-only`: the speech walks
        (`tts_walk`, `early_tts_walk`), whose draws never want a text id. A
        model without an audio window, or whose default walk is not one of
        them, can not serve so."""
        walks = tuple(w for w in (self.tts_walk, self.early_tts_walk) if w is not None)
        if not walks or self.default_walk not in walks or not any(self.audio_logits(c) for c in self.components):
            raise ConfigError(f"--audio-logits-only is for models that speak from ids of their own (Orpheus); "
                              f"model '{self.name}' has none")
        return walks

    def default_dtype(self, device: torch.device) -> torch.dtype:
        import torch

        return torch.float32 if device.type == "cpu" else torch.bfloat16

    def graph_rows(self, component: str, mode: str) -> tuple[RowShape, ...] | None:
        """The per-row inputs (in the mode's input order) at which a plain
        mode's step is captured as CUDA graphs; None: the mode runs eagerly
        (its rows vary in shape, or a graph would not pay)."""
        return None

    def graph_shapes(self, component: str, mode: str) -> tuple[tuple[RowShape, ...], ...]:
        """Every set of per-row inputs a plain mode's graphs are captured
        for: `graph_rows` alone unless a model lists more (a mode whose rows
        come in a few known shapes runs none of them eagerly); () for none."""
        rows = self.graph_rows(component, mode)
        return () if rows is None else (rows,)

    def split_placement(self, num_devices: int) -> dict[str, list[int]] | None:
        """`--placement split`: component -> device indices (into --gpus);
        None: the model has no split of its own."""
        return None

    # -- what the runtime calls
    def build_component(self, component: str, device: torch.device, dtype: torch.dtype) -> nn.Module:
        """The component's module, weights loaded, on `device`. Each mode of
        the component is a method of the module named after the mode. A module
        that captures CUDA graphs of its own has an `enforce_eager` attribute,
        which the runtime sets from `--enforce-eager`. Called on each device
        worker's thread: GPU workers' calls may run at once, CPU workers'
        (which a model may hand one module) run one at a time."""
        raise NotImplementedError

    def prepare(self, request: GenerateRequest, plan: WalkPlan | None = None) -> Prepared:
        """Everything the walk `plan` (default: the request's walk, compiled
        here) starts from. Sampling is resolved and validated first, once per
        sampling key (`prepared.resolve_sampling`), then the inputs are
        prepared under the root key's params (a language model tokenises its
        prompt and applies its chat template here), then the root's
        `max_tokens` is fitted to the context the prompt leaves
        (`prepared.fit_context`). Raises `RequestError` for bad input."""
        if plan is None:
            plan = self._compile(self.walk_for(request))
        sampling = resolve_sampling(request, plan, self.default_sampling, self.max_model_len)
        return self._prepared(request, plan, self.prepare_inputs(request, sampling[plan.root]), sampling)

    def resample(self, request: GenerateRequest, plan: WalkPlan, prepared: Prepared) -> Prepared:
        """`prepared` (of a request with the same inputs on walk `plan`) with
        `request`'s own sampling, resolved, seeded and fitted as `prepare`
        would: another sample of one prompt, without preparing its inputs
        again."""
        sampling = resolve_sampling(request, plan, self.default_sampling, self.max_model_len)
        piece = PreparedPiece(prepared.values, prepared.num_prompt_tokens, prepared.prompt_field)
        return self._prepared(request, plan, piece, sampling)

    def _prepared(self, request: GenerateRequest, plan: WalkPlan, piece: PreparedPiece,
                  sampling: dict[str, SamplingParams]) -> Prepared:
        sampling = fit_context(sampling, plan, self.components, piece, self.max_model_len, self.default_sampling,
                               self.min_turn_tokens)
        return Prepared(piece.values, sampling, stop_ids(sampling, self.eos_ids), piece.num_tokens, plan.name,
                        piece.field, (request.request_id, request.sampling, dict(request.sampling_by)))

    def prepare_inputs(self, request: GenerateRequest, sampling: SamplingParams) -> PreparedPiece:
        """The walk's initial values (CPU tensors) from the request's inputs,
        the prompt tokens they hold and the input they came from (named if
        they leave no room in the context); `sampling`: the root key's
        params, resolved and valid (`max_tokens` None until the prompt's
        size is known). Raises `RequestError` for bad input."""
        raise NotImplementedError

    def prepare_more(self, request: GenerateRequest, inputs: dict[str, Any]) -> PreparedPiece:
        """One more piece of a running request's `more_input` (a walk that
        takes one), as values of that input, from raw `inputs` (`request`:
        the request as submitted, for what the piece inherits, a voice say)."""
        raise RequestError(f"model '{self.name}' takes no input while a request runs", field="input")

    def join_turn(self, last_token: int, piece: dict[str, torch.Tensor], start: int) -> PreparedPiece:
        """What the root partition starts its next turn from: the piece
        (`prepare_more`'s values) joined to the turn before, and the tokens
        the cache reads for it. Here: the turn's last sampled token (never fed
        back yet) before the piece's one input of token ids. `start`: the
        position the joined piece starts at (for a model that gives its own
        positions)."""
        import torch

        (name, ids), = piece.items()
        joined = torch.cat([torch.tensor([last_token], dtype=torch.long), ids.reshape(-1).long()])
        return PreparedPiece({name: joined}, joined.numel())

    def _compile(self, walk: str) -> WalkPlan:
        """A walk's plan, for callers of `prepare` without the engine's."""
        if walk not in self.walks:
            raise RequestError(f"unknown walk '{walk}'; this model has {sorted(self.walks)}", field="walk")
        return compile_walk(walk, self.walks[walk], self.components)
