"""A change of the simulator's parameters, as the what-if, the findings' effects and the advice pass
it: SimParams' field names -> the values to run with, which ``make_params`` checks and coerces."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from gputrace.sim.params import SimParams, make_params

ParamValue = int | float | str | tuple[int, ...] | tuple[float, ...] | tuple[tuple[int, int], ...] | None
"""The value of one of SimParams' fields: a number, a tuple (the load's levels, a layer split, the
recorded requests' lengths), a string (the engine; a ``--set`` value as typed, which
``make_params`` coerces), None (the engine's default, or no limit)."""

ParamChange = Mapping[str, ParamValue]
"""SimParams' field names -> their new values (``make_params`` rejects any other name)."""

ParamJson = int | float | str | list[float | tuple[int, int]] | None
"""A ParamValue as the what-if's and the advice's JSON give it: a tuple as a list."""


def param_json(value: ParamValue) -> ParamJson:
    if isinstance(value, tuple):
        items: list[float | tuple[int, int]] = list(value)
        return items
    return value


def with_changes(p: SimParams, change: ParamChange) -> SimParams:
    """``p`` with ``change`` applied, each value checked and coerced to its field's type."""
    return make_params({**{f.name: getattr(p, f.name) for f in dataclasses.fields(p)}, **change})
