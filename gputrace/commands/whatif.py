"""`gputrace whatif RUN --set key=value`: the simulator fitted to the run, run under the change."""

from __future__ import annotations

import json
from pathlib import Path

import click

from gputrace.analyse import analyse_run
from gputrace.errors import UsageError
from gputrace.sim.params import parse_set_options
from gputrace.store import Store
from gputrace.whatif.advise import OBJECTIVES, Advice, advisor, parse_slo
from gputrace.whatif.fit import fit_model
from gputrace.whatif.param_change import ParamValue
from gputrace.whatif.predict import CHANGEABLE, check_changes, predict
from gputrace.whatif.render import render_advice_markdown, render_markdown, whatif_document

FORMATS = ("md", "json")


@click.command("whatif")
@click.argument("run", type=click.Path(exists=True, file_okay=False, path_type=str))
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
              help=f"A change (repeatable): {', '.join(CHANGEABLE)} (vLLM's max_num_seqs is "
                   "max_running_requests).")
@click.option("--concurrency", default=None, metavar="C1,C2",
              help="Load levels to predict (default: the run's).")
@click.option("--search", is_flag=True, help="Search the engine's settings for the configuration that serves "
              "the run's load best (the advice report opens with).")
@click.option("--objective", type=click.Choice(OBJECTIVES), default=None,
              help="With --search: throughput (default: most duration-weighted gain, no phase losing beyond "
                   "its band), peak (the highest level), slo (needs --slo).")
@click.option("--slo", default=None, metavar="ttft_p90=2s,itl_p90=80ms",
              help="With --search: every phase must meet it (implies --objective slo).")
@click.option("--format", "formats", default="md", show_default=True, help="Comma-separated: md, json.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=str), default=None,
              help="Write whatif.md / whatif.json here instead of printing.")
def command(run: str, sets: tuple[str, ...], concurrency: str | None, search: bool, objective: str | None,
            slo: str | None, formats: str, out_dir: str | None) -> None:
    """Predict what a change of setting or load would give, from the simulator fitted to RUN.

    Per phase: throughput, TTFT and ITL p50/p90, bubble per stage, measured -> predicted, with a
    band from the fit's residuals. Example: --set pp_max_micro_batch_size=4.
    """
    fmts = [f.strip() for f in formats.split(",") if f.strip()]
    bad = [f for f in fmts if f not in FORMATS]
    if bad or not fmts:
        raise UsageError(f"--format {formats!r}: choose from {', '.join(FORMATS)}")
    if (objective or slo) and not search:
        raise UsageError("--objective and --slo go with --search")
    if search and (sets or concurrency):
        raise UsageError("--search searches the settings itself: give it without --set/--concurrency")
    if search:
        _search(run, objective or ("slo" if slo else "throughput"), parse_slo(slo), fmts, out_dir)
        return
    changes: dict[str, ParamValue] = dict(parse_set_options(sets))
    if concurrency is not None:
        changes["concurrency"] = concurrency
    with Store.open(run, read_only=True) as store:
        analysis = analyse_run(store, effects=False)
    changes = check_changes(analysis.run.engine, analysis.run.pp_size, changes)
    click.echo(f"fitting the simulator to {run} ...", err=True)
    model = fit_model(analysis)
    doc = whatif_document(run, model, changes, predict(model, changes))
    texts = {"md": render_markdown(doc), "json": json.dumps(doc, indent=2, default=str) + "\n"}
    _write(texts, fmts, out_dir)


def _write(texts: dict[str, str], fmts: list[str], out_dir: str | None, stem: str = "whatif") -> None:
    if out_dir is None:
        for f in fmts:
            click.echo(texts[f], nl=False)
        return
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    for f in fmts:
        path = Path(out_dir) / f"{stem}.{f}"
        path.write_text(texts[f])
        click.echo(f"wrote {path}")


def _search(run: str, objective: str, slo: dict[str, float], fmts: list[str], out_dir: str | None) -> None:
    hook = advisor(objective, slo)
    click.echo(f"fitting the simulator to {run} and searching its settings ...", err=True)
    with Store.open(run, read_only=True) as store:
        analysis = analyse_run(store, effects=False, advise=hook)
    if not isinstance(analysis.advice, Advice):  # None: the advisor had nothing to fit
        raise UsageError(f"{run}: no phase with a throughput the what-if model can be fitted to: "
                         "nothing to advise")
    advice = analysis.advice.to_dict()
    doc = {"schema": "gputrace.advice/1", "run": run, **advice}
    texts = {"md": render_advice_markdown(run, advice), "json": json.dumps(doc, indent=2, default=str) + "\n"}
    _write(texts, fmts, out_dir, "advice")
