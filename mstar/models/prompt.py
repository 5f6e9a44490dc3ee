"""A language model's prompt: a request's `prompt_ids`, `prompt` (text) or
`messages` (chat) in, checked token ids out, with the input they came from.

Text is encoded with the tokenizer's special tokens. Messages go through the
tokenizer's chat template (with the assistant's opening unless the request's
`add_generation_prompt` is false), and the text it renders is encoded
without special tokens: the template placed them. A text that could not fit
the context, whatever its tokens turn out to be, is refused before it is
tokenised; every id must be inside the model's vocabulary. Errors name the
input as clients know it: `prompt` (text or ids) or `messages`, and `model`
when a text comes to a model without a tokenizer.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from mstar.errors import CONTEXT_EXCEEDED, RequestError

if TYPE_CHECKING:
    from mstar.models.tokenizer import Tokenizer

PROMPT_INPUTS = ("prompt_ids", "prompt", "messages")  # one of them, in a request's inputs


def prompt_tokens(inputs: Mapping[str, Any], tokenizer: Tokenizer | None, vocab_size: int, max_model_len: int,
                  model: str) -> tuple[list[int], str]:
    """The prompt's token ids, and the input they came from (`prompt` or
    `messages`). Raises `RequestError` naming the field at fault."""
    given = [name for name in PROMPT_INPUTS if name in inputs]
    if len(given) > 1:
        raise RequestError(f"give one of {', '.join(PROMPT_INPUTS)}, not {' and '.join(given)}", field="prompt")
    if "messages" in inputs:
        field = "messages"
        ids = chat_ids(inputs["messages"], generation_prompt(inputs), need_tokenizer(tokenizer, model), max_model_len,
                       template_variables(inputs))
    elif "prompt" in inputs:
        field = "prompt"
        ids = text_ids(inputs["prompt"], need_tokenizer(tokenizer, model), max_model_len)
    else:
        field = "prompt"
        ids = given_ids(inputs.get("prompt_ids"))
        if not ids:
            raise RequestError("the prompt is empty", field=field)
    if ids and not 0 <= min(ids) <= max(ids) < vocab_size:
        bad = next(t for t in ids if not 0 <= t < vocab_size)
        raise RequestError(f"token id {bad} is outside the vocabulary [0, {vocab_size})", field=field)
    return ids, field


def text_ids(text: Any, tokenizer: Tokenizer, max_model_len: int) -> list[int]:
    """A text through the tokenizer, with its special tokens."""
    if not isinstance(text, str):
        raise RequestError("must be a string", field="prompt")
    check_length(tokenizer, len(text), max_model_len, "prompt")
    ids = list(tokenizer.encode(text, add_special_tokens=True))
    if not ids:
        raise RequestError("the prompt has no tokens", field="prompt")
    return ids


def chat_ids(messages: Any, add_generation_prompt: bool, tokenizer: Tokenizer, max_model_len: int,
             variables: Mapping[str, Any] | None = None) -> list[int]:
    """Messages through the chat template (given `variables` too), then the
    tokenizer without special tokens (the template placed them)."""
    ids = list(tokenizer.encode(chat_text(messages, add_generation_prompt, tokenizer, max_model_len,
                                          variables=variables), add_special_tokens=False))
    if not ids:
        raise RequestError("the messages have no tokens", field="messages")
    return ids


def chat_text(messages: Any, add_generation_prompt: bool, tokenizer: Tokenizer, max_model_len: int,
              media: Collection[str] = (), variables: Mapping[str, Any] | None = None) -> str:
    """Messages through the chat template (`media`: the kinds of content
    part it is given as parts; `variables`: more it reads;
    `Tokenizer.apply_chat_template`'s)."""
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise RequestError("must be a non-empty list of messages", field="messages")
    chars = sum(len(m["content"]) for m in messages if isinstance(m, Mapping) and isinstance(m.get("content"), str))
    check_length(tokenizer, chars, max_model_len, "messages")
    try:
        return tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt,
                                             media=media, variables=variables)
    except (ValueError, TypeError, KeyError) as e:
        raise RequestError(f"the chat template refused these messages: {e}", field="messages") from None
    except Exception as e:  # jinja's TemplateError is raised by a template's raise_exception()
        if type(e).__module__.startswith("jinja2"):
            raise RequestError(f"the chat template refused these messages: {e}", field="messages") from None
        raise


def given_ids(value: Any) -> list[int]:
    """Token ids as a request gave them: a list of ints or a 1-D integer tensor."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 1 or value.dtype.is_floating_point or value.dtype == torch.bool:
            raise RequestError("must be a 1-D integer tensor", field="prompt")
        return value.tolist()
    if value is None:
        return []
    if type(value) is list and set(map(type, value)) <= {int}:  # the usual case, without a Python loop
        return list(value)
    if not isinstance(value, (list, tuple)) or not all(
            type(t) is int or (isinstance(t, int) and not isinstance(t, bool)) for t in value):
        raise RequestError("must be a list of integer token ids", field="prompt")
    return list(value)


def check_length(tokenizer: Tokenizer, chars: int, max_model_len: int, field: str) -> None:
    """Refuse a text that cannot fit the context before tokenising it: it has
    at least `chars / max_token_bytes` tokens, whatever they turn out to be."""
    per_token = getattr(tokenizer, "max_token_bytes", None)
    if per_token and chars > max_model_len * per_token:
        raise RequestError(
            f"the prompt is {chars} characters, so at least {chars // per_token} tokens, more than the model's "
            f"context of {max_model_len} tokens", field=field, code=CONTEXT_EXCEEDED)


def need_tokenizer(tokenizer: Tokenizer | None, model: str) -> Tokenizer:
    """The model's tokenizer; without one, a text prompt is the request's error."""
    if tokenizer is None:
        raise RequestError(f"model '{model}' has no tokenizer: send token ids", field="model")
    return tokenizer


def template_variables(inputs: Mapping[str, Any]) -> dict[str, Any]:
    """A chat's `chat_template_kwargs` (vLLM's): more variables its template
    reads, such as Qwen's `enable_thinking`; `Tokenizer.apply_chat_template`
    refuses the names it sets or the template's environment has."""
    value = inputs.get("chat_template_kwargs")
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise RequestError("must be an object", field="chat_template_kwargs")
    for key in value:
        if not isinstance(key, str) or not key.isidentifier():
            raise RequestError(f"{key!r} is not a template variable's name", field="chat_template_kwargs")
    return dict(value)


def generation_prompt(inputs: Mapping[str, Any]) -> bool:
    """A chat's `add_generation_prompt` (the assistant's opening after the messages; true unless given)."""
    value = inputs.get("add_generation_prompt", True)
    if not isinstance(value, bool):
        raise RequestError("must be a boolean", field="add_generation_prompt")
    return value
