"""The JSON form of a ``Plan``, and the schema a saved plan is checked against when read.

A saved plan is checked whole before a ``Plan`` is built from it: the type of every field, a
non-blank strategy name, a positive budget, a non-blank graph hash, no field this memfit does not
know. The first problem raises ``ValueError`` naming the field (``budget_bytes``,
``decisions['h1'].swap_ins[0].after``) and what it should hold, so a hand-edited or truncated
file fails at ``Plan.load``, before any model is touched, never as a ``KeyError`` mid-step.
The strategy is the plan's label, not looked up in the registry: a saved plan runs as it is and
is never planned again, so one made by a strategy this process has not registered runs too.

``Plan`` (``memfit.data.plan``) writes its own JSON form and builds itself from ``plan_fields``,
so this module stays below it (no import loop).
"""

from __future__ import annotations

import functools
import reprlib
import types
import typing
from collections.abc import Callable, Collection, Mapping
from dataclasses import MISSING, fields, is_dataclass
from typing import TYPE_CHECKING, Any

from memfit.data.decisions import Decision, Keep, Recompute, Rerun, Swap, SwapIn

if TYPE_CHECKING:
    from memfit.data.explanation import Explanation

FORMAT = "memfit.plan"
FORMAT_VERSION = 1  # bump when a saved plan would be read differently
REQUIRED = ("format", "version", "strategy", "graph_hash", "decisions")
OPTIONAL = ("topology_hash", "params", "budget_bytes", "hardware", "reruns", "explanation",
            "regions")
DECISION_FIELDS = {"Keep": {"type", "reason"}, "Recompute": {"type", "reason"},
                   "Swap": {"type", "swap_ins", "reason"}}
FIX = "fix the file, or plan again and save it with plan.save(path)"


class PlanFileError(ValueError):
    """A saved plan that does not follow the schema; the message names the field."""


def plan_fields(data: object, source: str = "the saved plan") -> dict[str, Any]:
    """The keyword arguments of ``Plan`` that ``data`` (``Plan.to_json``'s form) holds, checked.

    ``regions`` holds each region's own JSON object, as ``data`` has it (checked to be a list):
    ``Plan.from_json`` reads each as a plan of its own.

    Raises:
        PlanFileError: (a ``ValueError``) naming the first field that is missing, unknown or of
            the wrong type or value; for a file of another format version, which memfit made it.
    """
    _check_header(data, source)
    assert isinstance(data, Mapping)
    unknown = sorted(set(data) - set(REQUIRED) - set(OPTIONAL))
    if unknown:
        raise PlanFileError(f"{source} has unknown field(s) {unknown}: a plan has "
                            f"{list(REQUIRED + OPTIONAL)}; {FIX}")
    missing = [name for name in REQUIRED if name not in data]
    if missing:
        raise PlanFileError(f"{source} lacks the field(s) {missing}; {FIX}")
    read = _Reader(source)
    decisions = read.mapping(data["decisions"], "decisions")
    return {
        "strategy": read.text(data["strategy"], "strategy", blank=False),
        "graph_hash": read.text(data["graph_hash"], "graph_hash", blank=False),
        "params": read.mapping(data.get("params", {}), "params"),
        "budget_bytes": read.budget(data.get("budget_bytes")),
        "hardware": read.text(data.get("hardware", ""), "hardware"),
        "decisions": {name: read.decision(d, f"decisions[{name!r}]")
                      for name, d in decisions.items()},
        "reruns": tuple(read.rerun(r, f"reruns[{i}]")
                        for i, r in enumerate(read.array(data.get("reruns", []), "reruns"))),
        "topology_hash": read.text(data.get("topology_hash", ""), "topology_hash"),
        "explanation": read.explanation(data.get("explanation")),
        "regions": read.array(data.get("regions", []), "regions"),
    }


def _check_header(data: object, source: str) -> None:
    """A JSON object that says it is a memfit plan, of this memfit's format version."""
    if not isinstance(data, Mapping) or ("format" not in data and "decisions" not in data):
        raise PlanFileError(f"{source} is not a memfit plan (no 'format': {FORMAT!r}); save one "
                            "with plan.save(path)")
    if data.get("format") != FORMAT:
        raise PlanFileError(f"{source}: field 'format' must be {FORMAT!r}, got "
                            f"{_short(data.get('format'))}; {FIX}")
    version = data.get("version")
    if type(version) is not int or version != FORMAT_VERSION:
        older = version is None or (type(version) is int and version < FORMAT_VERSION)
        raise PlanFileError(
            f"{source} has format version {_short(version)}, this memfit reads version "
            f"{FORMAT_VERSION}: it was made by {'an older' if older else 'a newer'} memfit; plan "
            "again with memfit.plan(...) and save it with this version")


class _Reader:
    """Typed reads of one saved plan's fields; each failure names the field and its type."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, where: str, expected: str, value: object) -> PlanFileError:
        return PlanFileError(f"{self.source}: field '{where}' must be {expected}, got "
                             f"{_short(value)}; {FIX}")

    def text(self, value: object, where: str, blank: bool = True) -> str:
        if not isinstance(value, str) or (not blank and not value.strip()):
            raise self.fail(where, "a string" if blank else "a non-blank string", value)
        return value

    def mapping(self, value: object, where: str) -> dict:
        if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
            raise self.fail(where, "an object with string keys", value)
        return dict(value)

    def array(self, value: object, where: str) -> list:
        if not isinstance(value, list | tuple):
            raise self.fail(where, "a list", value)
        return list(value)

    def budget(self, value: object) -> int | None:
        if value is not None and (type(value) is not int or value <= 0):
            raise self.fail("budget_bytes", "a positive integer of bytes or null", value)
        return value

    def decision(self, value: object, where: str) -> Decision:
        data = self.mapping(value, where)
        kind = data.get("type")
        if kind not in DECISION_FIELDS:
            raise PlanFileError(f"{self.source}: unknown decision type {_short(kind)} in field "
                                f"'{where}.type': expected 'Keep', 'Swap' or 'Recompute'; {FIX}")
        self.known(data, DECISION_FIELDS[kind], where)
        reason = self.text(data.get("reason", ""), f"{where}.reason")
        if kind == "Keep":
            return Keep(reason)
        if kind == "Recompute":
            return Recompute(reason)
        swap_ins = self.array(data.get("swap_ins"), f"{where}.swap_ins")
        if not swap_ins:
            raise self.fail(f"{where}.swap_ins", "a non-empty list (use Keep for no swap)", [])
        return Swap(tuple(self.swap_in(s, f"{where}.swap_ins[{i}]")
                          for i, s in enumerate(swap_ins)), reason)

    def swap_in(self, value: object, where: str) -> SwapIn:
        data = self.mapping(value, where)
        self.known(data, {"after", "consumers"}, where)
        consumers = self.array(data.get("consumers"), f"{where}.consumers")
        return SwapIn(self.text(data.get("after"), f"{where}.after", blank=False),
                      tuple(self.text(c, f"{where}.consumers[{i}]", blank=False)
                            for i, c in enumerate(consumers)))

    def rerun(self, value: object, where: str) -> Rerun:
        pair = self.array(value, where)
        if len(pair) != 2:
            raise self.fail(where, "a pair [op, before]", value)
        return Rerun(self.text(pair[0], f"{where}[0]", blank=False),
                     self.text(pair[1], f"{where}[1]", blank=False))

    def known(self, data: Mapping, allowed: set[str], where: str) -> None:
        unknown = sorted(set(data) - allowed)
        if unknown:
            raise PlanFileError(f"{self.source}: unknown field(s) {unknown} in '{where}': it "
                                f"has {sorted(allowed)}; {FIX}")

    def explanation(self, value: object) -> Explanation | None:
        """The explanation, its fields checked against their declared types."""
        from memfit.data.explanation import Explanation, Tally, TensorRow, WhatIf

        if value is None:
            return None
        data = self.mapping(value, "explanation")
        nested = {"rows": TensorRow, "what_if": WhatIf}
        self.dataclass_fields(Explanation, data, "explanation", skip={*nested, "tally"})
        for name, kind in nested.items():
            for i, row in enumerate(self.array(data.get(name, []), f"explanation.{name}")):
                self.dataclass_fields(kind, self.mapping(row, f"explanation.{name}[{i}]"),
                                      f"explanation.{name}[{i}]")
        if data.get("tally") is not None:
            self.dataclass_fields(Tally, self.mapping(data["tally"], "explanation.tally"),
                                  "explanation.tally")
        return Explanation.from_json(data)

    def dataclass_fields(self, kind: type, data: Mapping, where: str,
                         skip: Collection[str] = ()) -> None:
        """Each field of dataclass ``kind`` in ``data``: present unless defaulted, of its type."""
        checks = _field_checks(kind)
        self.known(data, {name for name, _, _, _ in checks}, where)
        for name, required, fits, hint in checks:
            if name in skip:
                continue
            if name not in data:
                if required:
                    raise PlanFileError(f"{self.source}: field '{where}.{name}' is missing; {FIX}")
                continue
            if not fits(data[name]):
                raise self.fail(f"{where}.{name}", _type_name(hint), data[name])


@functools.cache
def _field_checks(kind: type) -> tuple[tuple[str, bool, Callable[[Any], bool], Any], ...]:
    """Each field of dataclass ``kind``: its name, whether it must be given (no default), the
    check of a JSON value against its declared type (``_fits``), and that type; resolved once
    per class (a plan reads thousands of fields)."""
    assert is_dataclass(kind)
    hints = typing.get_type_hints(kind)
    return tuple((item.name, item.default is MISSING and item.default_factory is MISSING,
                  _fits(hints[item.name]), hints[item.name]) for item in fields(kind))


def _fits(hint: Any) -> Callable[[Any], bool]:
    """Whether a JSON value fits the declared type ``hint`` (a JSON list stands for a tuple),
    as a function made once per field."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        options = tuple(_fits(arg) for arg in args)
        return lambda value: any(fits(value) for fits in options)
    if origin is typing.Literal:
        return lambda value: value in args
    if origin is tuple:
        each = _fits(args[0])
        return lambda value: isinstance(value, list | tuple) and all(map(each, value))
    if hint is type(None):
        return lambda value: value is None
    if hint is float:
        return lambda value: type(value) in (int, float)
    if hint is int:
        return lambda value: type(value) is int
    return lambda value: isinstance(value, hint)


def _type_name(hint: Any) -> str:
    return str(hint).replace("typing.", "").replace("<class '", "").replace("'>", "")


def _short(value: object) -> str:
    return reprlib.repr(value)


def jsonable(value: Any) -> Any:
    """``value`` as JSON types; what JSON cannot hold, as its ``repr`` (a plan's params)."""
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [jsonable(v) for v in value]
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    return repr(value)
