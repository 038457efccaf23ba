"""The JSON form of a ``Hardware`` profile, checked field by field when read.

A saved profile names its format and version; every field has the JSON type its annotation
says (a rate is a number, ``duplex`` a boolean, ``flops_per_s`` an object of numbers). The first
problem raises ``ValueError`` naming the field, so a hand-edited profile fails when loaded,
not as a wrong step time later. ``Hardware`` then checks the numbers themselves.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import MISSING, Field
from typing import Any

FORMAT = "memfit.hardware"
FORMAT_VERSION = 1
FIX = "fix the file, or save a profile with hardware.save(path)"
_NUMBER = "a number"
_KINDS = {  # field -> the JSON kind it holds (a field not listed is a number)
    "name": "a string", "notes": "a string", "device_type": "a string", "duplex": "a boolean",
    "async_copies": "a boolean", "tf32_matmuls": "a boolean", "tf32_cudnn": "a boolean",
    "device_bytes": "an integer", "cache_bytes": "an integer",
    "flops_per_s": "an object of numbers", "compute_efficiency": "an object of numbers",
    "element_rates": "an object of numbers",
    "d2h_pageable_bytes_per_s": "a number or null", "h2d_pageable_bytes_per_s": "a number or null",
    "host_bytes": "an integer or null", "gpus_per_node": "an integer",
    "collective_bytes_per_s": "a number or null", "network_bytes_per_s": "a number or null",
}


def hardware_fields(data: object, source: str, declared: Iterable[Field]) -> dict[str, Any]:
    """The keyword arguments of ``Hardware`` that ``data`` (``to_json``'s form) holds.

    Args:
        declared: ``dataclasses.fields(Hardware)``, passed in: ``Hardware`` builds itself from
            the result, so this module stays below it (no import loop).

    Raises:
        ValueError: for another format or version, an unknown or missing field, or a field
            of the wrong JSON type; the message names it.
    """
    if not isinstance(data, Mapping) or data.get("format") != FORMAT:
        raise ValueError(f"{source} is not a memfit hardware profile (no 'format': {FORMAT!r}); "
                         f"{FIX}")
    if data.get("version") != FORMAT_VERSION:
        raise ValueError(f"{source} has format version {data.get('version')!r}, this memfit "
                         f"reads version {FORMAT_VERSION}: measure or save the profile again")
    known = {item.name: item for item in declared}
    values = {key: value for key, value in data.items() if key not in ("format", "version")}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ValueError(f"{source} has unknown field(s) {unknown}: a profile has "
                         f"{sorted(known)}; {FIX}")
    missing = [name for name, item in known.items() if name not in values
               and item.default is MISSING and item.default_factory is MISSING]
    if missing:
        raise ValueError(f"{source} lacks the field(s) {missing}; {FIX}")
    if "device_type" not in values:  # saved before the field: a CPU copies on its own thread
        values["device_type"] = "cpu" if values.get("async_copies") is False else "cuda"
    for key, value in values.items():
        expected = _KINDS.get(key, _NUMBER)
        if not _holds(value, expected):
            raise ValueError(f"{source}: field {key!r} must be {expected}, got {value!r}; {FIX}")
    return values


def _holds(value: object, expected: str) -> bool:
    """Whether a JSON value is of the kind ``_KINDS`` names (a boolean is not a number)."""
    def number(item: object) -> bool:
        return isinstance(item, int | float) and not isinstance(item, bool)

    if expected == "a string":
        return isinstance(value, str)
    if expected == "a boolean":
        return isinstance(value, bool)
    if expected == "an integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if expected == "an object of numbers":
        return isinstance(value, Mapping) and all(
            isinstance(key, str) and number(item) for key, item in value.items())
    if expected == "an integer or null":
        return value is None or _holds(value, "an integer")
    if expected == "a number or null":
        return value is None or number(value)
    return number(value)
