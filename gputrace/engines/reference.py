"""The knob reference: one Markdown page per engine (docs/knobs-<engine>.md), generated from the
knob registry (each engine's ``knobs.py``) by `gputrace knobs --out docs`; a test fails when a
page and the registry drift apart."""

from __future__ import annotations

from pathlib import Path

from gputrace.engines.common import Engine
from gputrace.engines.knobs import Knob

COLUMNS = ("Flag", "Setting", "Type", "Default", "Range", "What it limits", "Simulated",
           "Causes that name it")


def page_name(engine: Engine) -> str:
    return f"knobs-{engine.kind}.md"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _row(knob: Knob) -> tuple[str, ...]:
    setting = f"`{knob.own_name}`" + ("" if knob.settable else " (not a `--set` key)")
    simulated = f"yes (`{knob.sim_param}`)" if knob.sim_param and knob.sim_param != knob.name else (
        "yes" if knob.simulated else "no")
    if not knob.serving:
        simulated += "; changes what the log shows only"
    flag = f"`{knob.flag}`" + (f" (the advice: {knob.value_flag})" if knob.value_flag else "")
    return (flag, setting, knob.type.__name__, knob.default_text, knob.range_text(), knob.limits,
            simulated, ", ".join(f"`{c}`" for c in knob.causes) or "none")


def knob_reference(engine: Engine) -> str:
    """The engine's page: every knob with its flag, gputrace's and the engine's name for it, type,
    default, valid range, what it limits, whether the simulator models it and the causes that
    name it."""
    lines = [
        f"# {engine.name}'s knobs",
        "",
        f"Generated from gputrace's knob registry (`gputrace/engines/{engine.kind}/knobs.py`) by "
        "`gputrace knobs --out docs` (or `make docs-knobs`); do not edit by hand: "
        "`tests/test_knob_reference.py` fails when this page and the registry differ.",
        "",
        f"The settings of {engine.name} that gputrace's findings, `gputrace whatif --set` and the advice "
        "name, in its own flags. `Setting` is the key `whatif --set` takes; `Simulated`: the simulator "
        "(and so the what-if and the advice) models it.",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    lines += ["| " + " | ".join(_cell(c) for c in _row(k)) + " |" for k in engine.knobs]
    return "\n".join(lines) + "\n"


def write_references(engines: list[Engine], out_dir: Path) -> list[Path]:
    """Write each engine's page into ``out_dir``; the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for engine in engines:
        path = out_dir / page_name(engine)
        path.write_text(knob_reference(engine))
        written.append(path)
    return written
