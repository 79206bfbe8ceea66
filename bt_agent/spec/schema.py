"""A small declarative validator for JSON data: strict types, every problem at once.

Why not pydantic: the agent is PID 1 and validates the spec on every start, and importing
pydantic and building the SDK's models costs about 150 ms, the whole start-up budget. The rules
themselves mirror the SDK's pydantic models exactly (see ``models``), and a test checks this
module's verdicts against the real SDK.

Each validator is a callable ``(value, path, problems) -> converted value | INVALID``. It appends a
:class:`~bt_agent.errors.Problem` for each thing wrong and never raises for bad input.

A type is declared once, as a dataclass whose fields carry their validators (:func:`rule`);
:func:`schema_for` derives the object's validator from it.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from bt_agent.errors import Problem

T = TypeVar("T")
E = TypeVar("E", bound=enum.Enum)


class _Invalid:
    def __repr__(self) -> str:
        return "INVALID"


INVALID: Any = _Invalid()
Validator = Callable[[Any, str, list[Problem]], Any]
Check = Callable[[Any], list[tuple[str, str, str]]]

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def join(path: str, key: str | int) -> str:
    """``runtime`` + ``start_commands`` -> ``runtime.start_commands``; ints, odd keys bracketed."""
    if isinstance(key, int):
        return f"{path}[{key}]"
    if _IDENTIFIER.match(key):
        return f"{path}.{key}" if path else key
    return f"{path}[{json.dumps(key)}]"


def describe(value: Any) -> str:
    """How a JSON value reads in an error: its type and a short rendering."""
    kinds = {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "a list",
        dict: "an object",
        type(None): "null",
    }
    kind = kinds.get(type(value), type(value).__name__)
    if isinstance(value, (dict, list)) or value is None:
        return kind
    text = json.dumps(value) if isinstance(value, str) else repr(value)
    return f"{kind} {text[:60] + '...' if len(text) > 60 else text}"


def string(min_length: int = 0) -> Validator:
    def check(value: Any, path: str, problems: list[Problem]) -> Any:
        if not isinstance(value, str):
            problems.append(
                Problem(path, f"expected a string, got {describe(value)}", _quote_hint(value))
            )
            return INVALID
        if len(value) < min_length:
            problems.append(
                Problem(path, "must not be empty", "give it a value or remove the field")
            )
            return INVALID
        if not valid_text(value):
            problems.append(
                Problem(
                    path,
                    "holds a lone surrogate escape (\\ud800-\\udfff), which is not text",
                    "write the character itself, or a valid pair of escapes",
                )
            )
            return INVALID
        return value

    return check


def valid_text(value: str) -> bool:
    """Whether ``value`` can be encoded as UTF-8 (JSON allows lone surrogate escapes, which
    no file name, environment or command line can hold)."""
    if value.isascii():
        return True
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _quote_hint(value: Any) -> str:
    return (
        f"write it in quotes: {json.dumps(str(value))}" if isinstance(value, (int, float)) else ""
    )


def _lax_integer(value: Any) -> bool:
    """What pydantic's lax mode turns into an int: bools, integral floats, digit strings."""
    if isinstance(value, str):
        return value.strip().lstrip("-").isdigit()
    return isinstance(value, bool) or (isinstance(value, float) and value.is_integer())


def integer(minimum: int | None = None, lax: bool = False) -> Validator:
    """Strict: a JSON integer only (``"2"`` and ``2.0`` are errors). Lax also takes ``"8"``."""

    def check(value: Any, path: str, problems: list[Problem]) -> Any:
        converted = int(value) if lax and _lax_integer(value) else value
        if type(converted) is not int:
            hint = (
                f"write {value} without quotes"
                if isinstance(value, str) and value.strip().lstrip("-").isdigit()
                else "write a whole number"
            )
            problems.append(Problem(path, f"expected an integer, got {describe(value)}", hint))
            return INVALID
        if minimum is not None and converted < minimum:
            problems.append(
                Problem(
                    path,
                    f"must be at least {minimum}, got {converted}",
                    f"use a value of {minimum} or more",
                )
            )
            return INVALID
        return converted

    return check


def boolean() -> Validator:
    def check(value: Any, path: str, problems: list[Problem]) -> Any:
        if type(value) is not bool:
            problems.append(
                Problem(
                    path,
                    f"expected true or false, got {describe(value)}",
                    "write true or false without quotes",
                )
            )
            return INVALID
        return value

    return check


def choice(enum_type: type[E], upper: bool = False) -> Validator:
    """One of an enum's values, as a string (optionally upper-cased first, as the SDK does)."""

    def check(value: Any, path: str, problems: list[Problem]) -> Any:
        text = value.upper() if upper and isinstance(value, str) else value
        try:
            return enum_type(text)
        except ValueError:
            allowed = ", ".join(json.dumps(m.value) for m in enum_type)
            problems.append(
                Problem(path, f"{describe(value)} is not allowed", f"use one of: {allowed}")
            )
            return INVALID

    return check


def nullable(inner: Validator) -> Validator:
    def check(value: Any, path: str, problems: list[Problem]) -> Any:
        return None if value is None else inner(value, path, problems)

    return check


def list_of(inner: Validator) -> Validator:
    def check(value: Any, path: str, problems: list[Problem]) -> Any:
        if not isinstance(value, list):
            problems.append(
                Problem(
                    path,
                    f"expected a list, got {describe(value)}",
                    "write it as a JSON list: [...]",
                )
            )
            return INVALID
        items = [inner(item, join(path, i), problems) for i, item in enumerate(value)]
        return INVALID if any(item is INVALID for item in items) else items

    return check


def dict_of(inner: Validator) -> Validator:
    def check(value: Any, path: str, problems: list[Problem]) -> Any:
        if not isinstance(value, dict):
            problems.append(
                Problem(
                    path,
                    f"expected an object, got {describe(value)}",
                    'write it as a JSON object: {"KEY": ...}',
                )
            )
            return INVALID
        items = {k: inner(v, join(path, k), problems) for k, v in value.items()}
        return INVALID if any(v is INVALID for v in items.values()) else items

    return check


def refined(inner: Validator, rule: Callable[[Any], tuple[str, str] | None]) -> Validator:
    """``inner``, then ``rule`` on its result: ``(message, hint)`` when the value is wrong."""

    def check(value: Any, path: str, problems: list[Problem]) -> Any:
        converted = inner(value, path, problems)
        if converted is INVALID:
            return INVALID
        found = rule(converted)
        if found is None:
            return converted
        problems.append(Problem(path, *found))
        return INVALID

    return check


def any_json() -> Validator:
    return lambda value, path, problems: value


def _extend(path: str, sub: str) -> str:
    """``path`` + an already-formatted relative path (``name``, ``a.b`` or ``[0].c``)."""
    if not sub:
        return path
    if not path or sub.startswith("["):
        return path + sub
    return f"{path}.{sub}"


_MISSING: Any = object()


@dataclass(frozen=True)
class Field:
    validator: Validator
    default: Any = _MISSING
    default_factory: Callable[[], Any] | None = None

    @property
    def required(self) -> bool:
        return self.default is _MISSING and self.default_factory is None

    def make_default(self) -> Any:
        return self.default_factory() if self.default_factory is not None else self.default


@dataclass(frozen=True)
class ObjectSchema(Generic[T]):
    """A JSON object turned into ``build(**fields)``.

    ``extra="forbid"`` reports unknown keys (with a "did you mean"); ``"allow"`` passes them to
    ``build`` as ``extra={...}``. ``before`` may rewrite or reject the raw dict; ``checks`` run
    once every field is valid and return ``(subpath, message, hint)`` tuples.
    """

    build: Callable[..., T]
    fields: Mapping[str, Field]
    extra: str = "forbid"
    before: Callable[[dict[str, Any]], list[tuple[str, str, str]]] | None = None
    checks: tuple[Check, ...] = field(default=())

    def __call__(self, value: Any, path: str, problems: list[Problem]) -> Any:
        if not isinstance(value, dict):
            problems.append(
                Problem(
                    path,
                    f"expected an object, got {describe(value)}",
                    'write it as a JSON object: {"field": ...}',
                )
            )
            return INVALID
        ok = self._report(self.before(value) if self.before else [], path, problems)
        values: dict[str, Any] = {}
        for name, spec in self.fields.items():
            if name in value:
                values[name] = spec.validator(value[name], join(path, name), problems)
            elif spec.required:
                problems.append(Problem(join(path, name), "required field is missing", "add it"))
                values[name] = INVALID
            else:
                values[name] = spec.make_default()
        extra = {k: v for k, v in value.items() if k not in self.fields}
        if extra and self.extra == "forbid":
            ok = self._unknown(extra, path, problems) and ok
        if not ok or any(v is INVALID for v in values.values()):
            return INVALID
        built = self.build(**values, **({"extra": extra} if self.extra == "allow" else {}))
        return built if self._report(self._run_checks(built), path, problems) else INVALID

    def _run_checks(self, built: T) -> list[tuple[str, str, str]]:
        return [found for check in self.checks for found in check(built)]

    @staticmethod
    def _report(found: list[tuple[str, str, str]], path: str, problems: list[Problem]) -> bool:
        for sub, message, hint in found:
            problems.append(Problem(_extend(path, sub), message, hint))
        return not found

    def _unknown(self, extra: dict[str, Any], path: str, problems: list[Problem]) -> bool:
        for key in extra:
            close = difflib.get_close_matches(key, list(self.fields), n=1)
            hint = (
                f"did you mean {close[0]!r}?"
                if close
                else ("remove it; allowed fields: " + ", ".join(self.fields))
            )
            problems.append(Problem(join(path, key), "unknown field", hint))
        return False


def tagged(
    tag_of: Callable[[Any], str | None],
    members: Mapping[str, Validator],
    unknown: Callable[[Any], tuple[str, str]],
) -> Validator:
    """A union that picks its member by a tag computed from the raw value."""

    def check(value: Any, path: str, problems: list[Problem]) -> Any:
        tag = tag_of(value)
        if tag is None or tag not in members:
            message, hint = unknown(value)
            problems.append(Problem(path, message, hint))
            return INVALID
        return members[tag](value, path, problems)

    return check


_RULE = "bt_agent.spec.rule"


def rule(
    validator: Validator,
    default: Any = dataclasses.MISSING,
    default_factory: Any = dataclasses.MISSING,
) -> Any:
    """A dataclass field checked by ``validator``; optional as its default says."""
    return dataclasses.field(
        default=default, default_factory=default_factory, metadata={_RULE: validator}
    )


def schema_for(
    cls: type[T],
    extra: str = "forbid",
    before: Callable[[dict[str, Any]], list[tuple[str, str, str]]] | None = None,
    checks: tuple[Check, ...] = (),
) -> ObjectSchema[T]:
    """The validator of a JSON object that becomes a ``cls``, from its fields' rules (with
    ``extra="allow"``, unknown keys go to its ``extra`` field)."""
    fields: dict[str, Field] = {}
    for spec in dataclasses.fields(cls):  # type: ignore[arg-type]
        if extra == "allow" and spec.name == "extra":
            continue
        fields[spec.name] = Field(
            spec.metadata[_RULE],
            _MISSING if spec.default is dataclasses.MISSING else spec.default,
            None if spec.default_factory is dataclasses.MISSING else spec.default_factory,
        )
    return ObjectSchema(cls, fields, extra, before, checks)
