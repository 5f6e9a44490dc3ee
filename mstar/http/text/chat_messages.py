"""Chat messages in OpenAI's shape in, `{"role", "content": str}` dicts out,
ready for a Hugging Face chat template. Text parts are joined; other parts
(images, audio), tool calls and unknown roles are refused naming the field.
Importable without torch.
"""

from __future__ import annotations

from mstar.http.fields import Fields

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def read_messages(f: Fields) -> tuple[dict[str, str], ...]:
    """The body's `messages`, checked; `developer` becomes `system`."""
    value = f.raw("messages")
    if not isinstance(value, list) or not value:
        raise f.error("messages", "must be a non-empty array of messages")
    out = []
    for i, raw in enumerate(value):
        m = Fields(raw, f"messages[{i}].")
        role = m.string("role")
        if role not in CHAT_ROLES:
            raise m.error("role", f"must be one of {list(CHAT_ROLES)}, got {role!r}")
        m.unsupported_if_truthy("tool_calls")
        m.unsupported_if_truthy("function_call")
        content = _read_content(m, role)
        # Hugging Face chat templates know "system", not OpenAI's newer "developer".
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return tuple(out)


def _read_content(m: Fields, role: str) -> str:
    value = m.obj.get("content")
    if value is None:
        if role == "assistant":
            return ""
        raise m.error("content", "is required")
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise m.error("content", "must be a string or an array of content parts")
    texts = []
    for j, raw in enumerate(value):
        part = Fields(raw, f"{m.name('content')}[{j}].")
        kind = part.string("type")
        if kind != "text":
            raise part.error("type", f"content part type {kind!r} is not supported; only 'text' is")
        text = part.string("text")
        if text is None:
            raise part.error("text", "is required")
        texts.append(text)
    return "\n".join(texts)
