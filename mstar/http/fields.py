"""Typed reads of one JSON object's fields: a value comes in, a checked Python
value goes out, or a `RequestError` naming the field (with its path, such as
`messages[2].content`) is raised.

JSON has no int/bool distinction in Python's eyes (`True` is an `int`), so
every integer read refuses bools explicitly.
"""

from __future__ import annotations

import math
from collections.abc import Set as AbstractSet
from typing import Any

from mstar.errors import RequestError

_MISSING = object()
INT64_LIMIT = 2**63


def type_name(value: Any) -> str:
    """The JSON name of a decoded value's type, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def fold_seed(seed: int) -> int:
    """An int64 seed (OpenAI's and vLLM's) in the engine's [0, 2**63): a
    negative one lands on the top half."""
    return seed % INT64_LIMIT


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_int_list(value: Any) -> bool:
    return isinstance(value, list) and all(is_int(v) for v in value)


class Fields:
    """A JSON object whose fields are read with their types checked.

    `prefix` is prepended to field names in errors, so a nested object's
    errors name their full path. Absent and `null` both mean "use the default",
    as the OpenAI API treats them.
    """

    def __init__(self, obj: Any, prefix: str = "") -> None:
        if not isinstance(obj, dict):
            raise RequestError(f"must be a JSON object, not {type_name(obj)}", field=prefix.rstrip(".") or "body")
        self.obj: dict[str, Any] = obj
        self.prefix = prefix

    def name(self, key: str) -> str:
        return f"{self.prefix}{key}"

    def error(self, key: str, message: str) -> RequestError:
        return RequestError(message, field=self.name(key))

    def has(self, key: str) -> bool:
        return self.obj.get(key) is not None

    def raw(self, key: str, default: Any = None) -> Any:
        value = self.obj.get(key)
        return default if value is None else value

    def _get(self, key: str, default: Any) -> Any:
        value = self.obj.get(key, _MISSING)
        return default if value is _MISSING or value is None else value

    def integer(self, key: str, default: int | None = None, *, lo: int | None = None,
            hi: int | None = None) -> int | None:
        value = self._get(key, default)
        if value is None:
            return None
        # 2.0 is an integer to JSON; 2.5 is not.
        if isinstance(value, float) and not isinstance(value, bool) and value.is_integer():
            # a JSON integer past 64 bits the parser made a float (rounded: one just below -2**63 reads as it)
            if not -INT64_LIMIT < value < INT64_LIMIT:
                # the parser kept its magnitude, not its digits: show none that were never sent
                raise self.error(key, "is out of range: an integer must fit in 64 bits")
            value = int(value)
        if not is_int(value):
            raise self.error(key, f"must be an integer, not {type_name(value)}")
        # JSON integers are unbounded; past int64 no tensor or counter can hold them
        if not -INT64_LIMIT <= value < INT64_LIMIT:
            raise self.error(key, f"is out of range, got {value}")
        if lo is not None and value < lo:
            raise self.error(key, f"must be at least {lo}, got {value}")
        if hi is not None and value > hi:
            raise self.error(key, f"must be at most {hi}, got {value}")
        return value

    def seed(self, key: str = "seed") -> int | None:
        """A seed: any int64, as OpenAI and vLLM take it, folded into the
        engine's [0, 2**63) (a negative one onto the top half)."""
        value = self.integer(key)
        return None if value is None else fold_seed(value)

    def number(self, key: str, default: float | None = None, *, lo: float | None = None,
              hi: float | None = None, lo_open: bool = False) -> float | None:
        value = self._get(key, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.error(key, f"must be a number, not {type_name(value)}")
        value = float(value)
        if not math.isfinite(value):
            raise self.error(key, "must be finite")
        if lo is not None and (value <= lo if lo_open else value < lo):
            raise self.error(key, f"must be {'greater than' if lo_open else 'at least'} {lo}, got {value}")
        if hi is not None and value > hi:
            raise self.error(key, f"must be at most {hi}, got {value}")
        return value

    def boolean(self, key: str, default: bool = False) -> bool:
        value = self._get(key, default)
        if not isinstance(value, bool):
            raise self.error(key, f"must be a boolean, not {type_name(value)}")
        return value

    def string(self, key: str, default: str | None = None) -> str | None:
        value = self._get(key, default)
        if value is not None and not isinstance(value, str):
            raise self.error(key, f"must be a string, not {type_name(value)}")
        return value

    def stops(self, key: str, max_count: int = 16) -> tuple[str, ...]:
        """A string or a list of non-empty strings (OpenAI's `stop`)."""
        value = self._get(key, None)
        if value is None:
            return ()
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
            raise self.error(key, "must be a string or an array of strings")
        if any(not s for s in items):
            raise self.error(key, "must not contain empty strings")
        if len(items) > max_count:
            raise self.error(key, f"at most {max_count} stop strings are allowed")
        return tuple(items)

    def int_list(self, key: str, *, lo: int = 0, max_count: int = 1024) -> tuple[int, ...]:
        value = self._get(key, None)
        if value is None:
            return ()
        if not is_int_list(value):
            raise self.error(key, "must be an array of integers")
        if len(value) > max_count:
            raise self.error(key, f"at most {max_count} items are allowed")
        if any(v < lo for v in value):
            raise self.error(key, f"items must be at least {lo}")
        return tuple(value)

    def mapping(self, key: str) -> dict[str, Any]:
        """An object (empty when absent); its keys and values are for whoever reads it to check."""
        value = self._get(key, {})
        if not isinstance(value, dict):
            raise self.error(key, f"must be an object, not {type_name(value)}")
        return value

    def objects(self, key: str) -> dict[str, dict[str, Any]]:
        """An object whose every value is an object (mstar's `sampling_by`:
        sampling key -> fields); what the inner objects hold is checked by
        whoever reads them, naming `key.<name>.<field>`."""
        value = self._get(key, {})
        if not isinstance(value, dict):
            raise self.error(key, f"must be an object, not {type_name(value)}")
        for name, inner in value.items():
            if not isinstance(inner, dict):
                raise RequestError(f"must be an object, not {type_name(inner)}", field=f"{self.name(key)}.{name}")
        return value

    def sampling_by(self, key: str) -> dict[str, dict[str, Any]]:
        """mstar's `sampling_by` (`objects`), each key's `seed` folded as the
        top-level one is (`seed`); what else the entries hold, and a seed past
        int64, is for the model to check, naming `key.<name>.<field>`. `logprobs`
        is refused: an answer carries those its route's own field asks for, so an
        override's would be computed and then dropped without a word."""
        out = self.objects(key)
        for name, fields in out.items():
            if fields.get("logprobs") is not None:
                raise RequestError("is not taken here: ask for logprobs with the route's own field",
                                   field=f"{self.name(key)}.{name}.logprobs")
        return {name: {**fields, "seed": fold_seed(fields["seed"])}
                if is_int(fields.get("seed")) and -INT64_LIMIT <= fields["seed"] < INT64_LIMIT else fields
                for name, fields in out.items()}

    def refuse_unknown(self, known: AbstractSet[str]) -> None:
        """A 400 naming the first key not in `known`: a typo such as
        `max_toknes` would otherwise be ignored without a word."""
        for key in self.obj:
            if key not in known:
                raise self.error(key, f"unknown field; expected one of {sorted(known)}")

    def unsupported_if_truthy(self, key: str, what: str | None = None) -> None:
        value = self.obj.get(key)
        if value:
            raise self.error(key, f"{what or key} is not supported")


def read_voice(f: Fields) -> str | None:
    """The `voice` of a speech body or of a chat body's `audio`: a voice's
    name, or OpenAI's custom-voice object `{"id": name}`."""
    value = f.raw("voice")
    if isinstance(value, dict):
        fields = Fields(value, f.name("voice") + ".")
        value = fields.string("id")
        if value is None:
            raise f.error("voice", "an object voice needs an 'id'")
        fields.refuse_unknown({"id"})
    if value is not None and not isinstance(value, str):
        raise f.error("voice", f"must be a string or an object with an 'id', not {type_name(value)}")
    if value is not None and not value.strip():
        raise f.error("voice", "must not be empty")
    return value
