"""A Qwen3-Omni request's prompt: `prompt_ids`, `prompt` (text) or `messages`
(chat, whose content may hold audio and image parts) in; the thinker's token
ids with every placeholder run expanded to its clip's or image's token count,
and the media in the order the placeholders take them, out.

Chat renders as the checkpoint's template does (ChatML: `<|im_start|>role\\n
... <|im_end|>\\n` per message, then the assistant's opening; each role is
its one token, as the config names it), at the level of ids (without the
assistant's opening when `add_generation_prompt` is false), so that media
placeholders are placed and counted here rather than found again in
rendered text: text through the tokenizer without special tokens, an audio
part as `<|audio_start|>` + n x `<|audio_pad|>` + `<|audio_end|>`, an image
part as `<|vision_start|>` + n x `<|image_pad|>` + `<|vision_end|>`. A
part's media arrive decoded (the HTTP layer decodes bytes off the event
loop): an audio part's `audio` is a mono float32 16 kHz waveform, an image
part's `image` RGB uint8 [H, W, 3].
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mstar.errors import CONTEXT_EXCEEDED, RequestError
from mstar.models.prompt import given_ids, text_ids
from mstar.models.qwen3_omni.config import TokenIds
from mstar.models.tokenizer import Tokenizer

ROLES = ("system", "user", "assistant")
VISION_END_OFFSET = 1  # `<|vision_end|>` is the id after `<|vision_start|>`
AUDIO_END_OFFSET = 1   # `<|audio_end|>` is the id after `<|audio_start|>`


@dataclass
class PromptMedia:
    """A prompt's media in placeholder order, each as the part it came from
    (its field) and the value a media hook made of it."""

    audio: list[tuple[str, Any]] = field(default_factory=list)
    images: list[tuple[str, Any]] = field(default_factory=list)


# a decoded part -> (what the encoder takes, the number of placeholder tokens it makes)
MediaHook = Callable[[Any, str], tuple[Any, int]]


@dataclass(frozen=True)
class Intake:
    """How this model reads prompts: its ids, tokenizer, and the hooks that
    turn a decoded audio clip or image into encoder input (None: the model has
    no encoder for it, and such a part is refused)."""

    ids: TokenIds
    tokenizer: Tokenizer | None
    audio: MediaHook | None = None
    image: MediaHook | None = None

    def prompt(self, inputs: Mapping[str, Any], max_model_len: int, model: str
               ) -> tuple[list[int], PromptMedia, str]:
        """The prompt's ids, its media, and the input they came from."""
        given = [name for name in ("prompt_ids", "prompt", "messages") if name in inputs]
        if len(given) != 1:
            raise RequestError(f"give exactly one of prompt_ids, prompt or messages (got {given or 'none'})",
                               field="prompt")
        media = PromptMedia()
        if inputs.get("chat_template_kwargs"):
            raise RequestError(f"model '{model}' lays out its chat itself, with no template to read these",
                               field="chat_template_kwargs")
        if "messages" in inputs:
            opening = inputs.get("add_generation_prompt", True)
            if not isinstance(opening, bool):
                raise RequestError("must be true or false", field="add_generation_prompt")
            return self._chat(inputs["messages"], media, max_model_len, model, opening), media, "messages"
        if "prompt" in inputs:
            return text_ids(inputs["prompt"], self._need_tokenizer(model), max_model_len), media, "prompt"
        ids = given_ids(inputs["prompt_ids"])
        if not ids:
            raise RequestError("the prompt is empty", field="prompt")
        return ids, media, "prompt"

    def _chat(self, messages: Any, media: PromptMedia, max_model_len: int, model: str,
              opening: bool = True) -> list[int]:
        if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
            raise RequestError("must be a non-empty list of messages", field="messages")
        ids: list[int] = []
        for m, message in enumerate(messages):
            where = f"messages[{m}]"
            if not isinstance(message, Mapping):
                raise RequestError(f"a message is an object whose role is one of {', '.join(ROLES)}", field=where)
            if message.get("role") not in ROLES:  # OpenAI's `developer` reached here as `system`
                raise RequestError(f"this model's chat takes the roles {', '.join(ROLES)} (and developer, as "
                                   f"system), not {message.get('role')!r}", field=f"{where}.role")
            ids += [self.ids.im_start, self._role(message["role"]), *self._text("\n", model)]
            ids += self._content(message.get("content"), f"{where}.content", media, model)
            ids += [self.ids.im_end, *self._text("\n", model)]
            if len(ids) > max_model_len:
                # counted no further: the rest of the messages' media is never decoded
                raise RequestError(f"the messages take more than the model's {max_model_len} tokens: "
                                   f"{len(ids)} up to the end of {where}",
                                   field="messages", code=CONTEXT_EXCEEDED)
        if not opening:  # the last message is continued as it stands
            return ids
        return ids + [self.ids.im_start, self.ids.assistant, *self._text("\n", model)]

    def _role(self, role: str) -> int:
        """A role's one token (Qwen's tokenizer has each as a single id; the checkpoint's config names them)."""
        return {"system": self.ids.system, "user": self.ids.user, "assistant": self.ids.assistant}[role]

    def content(self, content: Any, where: str, media: PromptMedia, model: str) -> list[int]:
        """A message's content (a string or parts) as ids, its media added to `media`."""
        return self._content(content, where, media, model)

    def text(self, text: str, model: str) -> list[int]:
        return self._text(text, model)

    def _content(self, content: Any, where: str, media: PromptMedia, model: str) -> list[int]:
        if isinstance(content, str):
            return self._text(content, model)
        if not isinstance(content, Sequence):
            raise RequestError("must be a string or a list of content parts", field=where)
        ids: list[int] = []
        for p, part in enumerate(content):
            at = f"{where}[{p}]"
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind == "text" and isinstance(part.get("text"), str):
                ids += self._text(part["text"], model)
            elif kind == "audio" and "audio" in part:
                encoded, n = self._hook(self.audio, "audio", part["audio"], at)
                media.audio.append((at, encoded))
                ids += [self.ids.audio_start, *[self.ids.audio] * n, self.ids.audio_start + AUDIO_END_OFFSET]
            elif kind == "image" and "image" in part:
                encoded, n = self._hook(self.image, "image", part["image"], at)
                media.images.append((at, encoded))
                ids += [self.ids.vision_start, *[self.ids.image] * n, self.ids.vision_start + VISION_END_OFFSET]
            else:
                raise RequestError("a content part is text ({type: text, text}), audio or an image", field=at)
        return ids

    def _hook(self, hook: MediaHook | None, kind: str, value: Any, at: str) -> tuple[Any, int]:
        if hook is None:
            raise RequestError(f"this model takes no {kind} input", field=f"{at}.type")
        return hook(value, at)

    def _text(self, text: str, model: str) -> list[int]:
        return list(self._need_tokenizer(model).encode(text, add_special_tokens=False))

    def _need_tokenizer(self, model: str) -> Tokenizer:
        if self.tokenizer is None:
            raise RequestError(f"model '{model}' has no tokenizer: send prompt_ids", field="model")
        return self.tokenizer
