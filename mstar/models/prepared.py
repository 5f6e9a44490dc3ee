"""A request's intake, resolved once: a `GenerateRequest` and its compiled walk
in, a `Prepared` out (the walk's initial values, the sampling and stop ids of
each sampling key, the prompt's token count); a later piece of input comes
out as a `PreparedPiece`.

A sampling key is, for now, the name of a partition that samples (it has a
step of a component with `samples`); the root partition's key is always
there, because its params are also what the event loop reads (stop strings,
logprobs). Each key's params are resolved in one order: the model's defaults
for the key, then the request's `sampling` for the root key, then the
request's `sampling_by[key]`. `SamplingParams.validate` runs here, once per
key, and nowhere else on the engine's path. Once the prompt's size is known,
the root key's `max_tokens` is fitted to the room it leaves in the context
(`fit_context`: None becomes the model's default budget for the key where
it has one, else all of that room, and never more than the room).
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mstar.errors import CONTEXT_EXCEEDED, ConfigError, RequestError
from mstar.graph import Component, WalkPlan, samples
from mstar.types import GenerateRequest, SamplingParams

if TYPE_CHECKING:
    from mstar.models.base import Model

SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))
_SEQUENCE_FIELDS = ("stop", "stop_token_ids")  # tuples in SamplingParams, arrays in an override
GREEDY_SEED = 0  # the seed of a greedy request that gives none


@dataclass(frozen=True)
class PreparedPiece:
    """Input in the walk's terms: `values` by walk input name (CPU tensors),
    how many tokens of the model's context they take, and the request's
    input they came from (the field named when they do not fit)."""

    values: dict[str, Any]
    num_tokens: int
    field: str = "input"


@dataclass(frozen=True)
class Prepared:
    """What the engine starts a request from. `sampling` and `stop_ids` are
    keyed by sampling key; every key's params carry a seed and a number of
    tokens. `walk`, `prompt_field` and `sampling_of` (the request id,
    `sampling` and `sampling_by` that `sampling` was resolved from) let another request
    of the same inputs start from it with its own sampling (`Model.resample`)."""

    values: dict[str, Any]
    sampling: dict[str, SamplingParams]
    stop_ids: dict[str, tuple[int, ...]]
    num_prompt_tokens: int
    walk: str = ""
    prompt_field: str = "input"
    sampling_of: tuple[str, SamplingParams, dict[str, Any]] | None = None

    def is_sampling_of(self, request: GenerateRequest) -> bool:
        """Whether `sampling` is `request`'s own; another request (a second
        sample of the same prompt, say) resolves its own, seed included."""
        return self.sampling_of == (request.request_id, request.sampling, request.sampling_by)


def check_roles(model: Model, plans: dict[str, WalkPlan]) -> None:
    """The walks a model names for its APIs are among its walks, and the key
    it names for a spoken answer's frames is a sampling key of its spoken
    walk (requests' `max_tokens` caps it); ConfigError otherwise."""
    for role, walk in (("tts_walk", model.tts_walk), ("early_tts_walk", model.early_tts_walk),
                       ("spoken_chat_walk", model.spoken_chat_walk)):
        if walk is not None and walk not in plans:
            raise ConfigError(f"model '{model.name}': its {role} '{walk}' is not one of its walks ({', '.join(plans)})")
    key, walk = model.spoken_audio_key, model.spoken_chat_walk
    if key is not None and (walk is None or key not in plans[walk].sampling_keys):
        raise ConfigError(f"model '{model.name}': its spoken_audio_key '{key}' is not a sampling key of its "
                          f"spoken_chat_walk '{walk}'")


def resolve_sampling(request: GenerateRequest, plan: WalkPlan, defaults: Callable[[str], SamplingParams],
                     max_model_len: int) -> dict[str, SamplingParams]:
    """Every sampling key's params, validated, each with a seed: the root
    keeps the request's (if it has none, a random one, or `GREEDY_SEED`
    when the root is greedy), another key without its own seed draws from
    `key_seed(root seed, key)`."""
    keys, draws = plan.sampling_keys, plan.draw_keys
    for key in request.sampling_by:
        if key not in keys:
            raise RequestError(f"walk '{plan.name}' has no sampling key '{key}'; its keys are {list(keys)}",
                               field=f"sampling_by.{key}")
    resolved: dict[str, SamplingParams] = {}
    for key in keys:
        base = request.sampling if key == plan.root else defaults(key)
        resolved[key] = _override(base, request.sampling_by.get(key), key, key == plan.root, max_model_len)
    for key in draws:  # a mode's own draws see no history of the tokens it drew
        for name, off in (("repetition_penalty", 1.0), ("presence_penalty", 0.0), ("frequency_penalty", 0.0)):
            if getattr(resolved[key], name) != off:
                raise RequestError(f"tokens of key '{key}' are drawn inside a step, which keeps no history of "
                                   f"them for a {name.replace('_', ' ')}", field=f"sampling_by.{key}.{name}")
    root = resolved[plan.root]
    if root.seed is not None:
        seed = root.seed
    elif root.temperature == 0:
        # a greedy request's other draws (a code predictor's tokens under their own key, a codec's noise) follow
        # a fixed seed: what asks for temperature 0 gets the same output on every run
        seed = GREEDY_SEED
    else:
        seed = random.getrandbits(63)
    return {key: params.replace(seed=seed if key == plan.root else
                                params.seed if params.seed is not None else key_seed(seed, key))
            for key, params in resolved.items()}


def _override(base: SamplingParams, fields: dict[str, Any] | None, key: str, root: bool,
              max_model_len: int) -> SamplingParams:
    """`base` with `fields` on top, validated. A field out of range is named
    `sampling_by.<key>.<field>`, unless it is the root's and the override
    did not set it: then it is the request's own (`max_tokens`, say), under
    the name the caller already knows."""
    where = f"sampling_by.{key}"
    if fields is None:
        fields = {}
    if not isinstance(fields, dict):
        raise RequestError("must be an object of sampling fields", field=where)
    changes: dict[str, Any] = {}
    for name, value in fields.items():
        if name not in SAMPLING_FIELDS:
            raise RequestError(f"is not a sampling field (known: {', '.join(sorted(SAMPLING_FIELDS))})",
                               field=f"{where}.{name}")
        if name in _SEQUENCE_FIELDS:
            if not isinstance(value, (list, tuple)):
                raise RequestError("must be an array", field=f"{where}.{name}")
            value = tuple(value)
        changes[name] = value
    params = base.replace(**changes) if changes else base
    try:
        params.validate(max_model_len)
    except RequestError as e:
        if root and e.field not in changes:
            raise
        raise RequestError(e.message, field=f"{where}.{e.field}", status=e.status, code=e.code) from None
    return params


def fit_context(sampling: dict[str, SamplingParams], plan: WalkPlan, components: dict[str, Component],
                piece: PreparedPiece, max_model_len: int,
                defaults: Callable[[str], SamplingParams] | None = None,
                min_answer: int = 1) -> dict[str, SamplingParams]:
    """Each key's params with a number of tokens: the prompt must leave room
    in the context (else the error names `piece.field`), the root's
    `max_tokens` must fit that room where the root samples tokens (its loops
    write them into the prompt's context; a denoising walk's root writes
    none), and a `max_tokens` of None, any key's, is the model's default
    budget for the key (`defaults(key).max_tokens`: Orpheus speaks up to 1200
    tokens) within that room, or all of the room where the model has none.
    A default is a ceiling, not a demand: a prompt that leaves less room
    than it shortens the answer instead of refusing the request (as a
    generation config's `max_new_tokens` does in vLLM). `min_answer`: the
    fewest tokens a root that samples must have room for to answer at all
    (`Model.min_turn_tokens`: a speech model's first window of audio); a
    prompt that leaves fewer is refused, not answered with nothing."""
    root = plan.root
    room = max_model_len - piece.num_tokens
    if room < 1:
        raise RequestError(f"the prompt is {piece.num_tokens} tokens but the model's context is {max_model_len} "
                           "tokens, leaving no room to generate", field=piece.field, code=CONTEXT_EXCEEDED)

    def root_samples() -> bool:  # asked only where a room or budget is short
        return any(samples(components[step.component], step.mode) for step in plan.partitions[root].steps)

    if room < min_answer and root_samples():
        raise RequestError(f"the prompt is {piece.num_tokens} tokens but the model's context is {max_model_len} "
                           f"tokens, leaving room for {room}, fewer than the {min_answer} its shortest answer takes",
                           field=piece.field, code=CONTEXT_EXCEEDED)
    asked = sampling[root].max_tokens
    if asked is not None and asked > room and root_samples():
        raise RequestError(f"{asked} tokens plus the {piece.num_tokens}-token prompt exceed the model's context of "
                           f"{max_model_len} tokens; at most {room} can be generated here", field="max_tokens",
                           code=CONTEXT_EXCEEDED)
    fitted: dict[str, SamplingParams] = {}
    for key, params in sampling.items():
        if params.max_tokens is None:
            budget = defaults(key).max_tokens if defaults is not None else None
            params = params.replace(max_tokens=room if budget is None else min(budget, room))
            if params.min_tokens > params.max_tokens:
                name = "min_tokens" if key == root else f"sampling_by.{key}.min_tokens"
                why = ("the model's default budget, which a max_tokens raises"
                       if budget is not None and budget < room else "the room its prompt leaves in the context")
                raise RequestError(f"{params.min_tokens} tokens are more than the {params.max_tokens} this request "
                                   f"can generate here: {why}", field=name)
        fitted[key] = params
    return fitted


def input_size(value: Any) -> int:
    """How large a request's raw inputs are, to tell a long prompt from a
    short one without reading it: characters of a text, ids of a list
    (lists of texts or messages are summed), elements of a tensor."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(input_size(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        # ids are counted, not walked: a million of them would take as long as the prepare spared
        nested = bool(value) and isinstance(value[0], (str, dict, list, tuple))
        return sum(input_size(v) for v in value) if nested else len(value)
    numel = getattr(value, "numel", None)
    if callable(numel):
        return numel()
    size = getattr(value, "size", None)  # a numpy array (decoded media)
    return size if isinstance(size, int) else 0


def key_seed(seed: int, key: str) -> int:
    """A key's seed from the request's: stable across processes (Python's
    `hash` of a str is salted per process), in [0, 2**63)."""
    digest = hashlib.blake2b(f"{seed}:{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def stop_ids(sampling: dict[str, SamplingParams],
             eos_ids: Callable[[str], tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The ids that end each key's token loops: the model's EOS ids of the
    key unless `ignore_eos`, then the key's `stop_token_ids`."""
    return {key: (() if p.ignore_eos else tuple(eos_ids(key))) + tuple(p.stop_token_ids)
            for key, p in sampling.items()}
