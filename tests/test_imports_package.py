"""The importers' package holds to its shape: every importer returns the one ImportReport, and only
``gputrace.imports.report.write_rows`` writes into the store."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import gputrace.imports
from gputrace.imports import engine_log, nvidia_smi, prometheus, request_files
from gputrace.imports.report import ImportReport

PACKAGE_DIR = Path(gputrace.imports.__file__).parent
IMPORTERS = [
    engine_log.ingest_log,
    nvidia_smi.parse_query_csv, nvidia_smi.parse_dmon,
    nvidia_smi.import_nvidia_smi_csv, nvidia_smi.import_nvidia_smi_dmon,
    request_files.parse_aiperf, request_files.import_aiperf,
    request_files.parse_guidellm, request_files.import_guidellm,
    request_files.parse_requests_jsonl, request_files.import_requests_jsonl,
    prometheus.import_prometheus,
]


def test_every_importer_returns_an_import_report() -> None:
    """Engine logs, nvidia-smi captures, request files and Prometheus: one result type."""
    returns = {fn.__qualname__: typing.get_type_hints(fn)["return"] for fn in IMPORTERS}
    assert {name: r for name, r in returns.items() if r is not ImportReport} == {}


def test_only_write_rows_appends_to_the_store() -> None:
    """No importer module calls the store's append methods itself."""
    calls = re.compile(r"\.append_columns\(|\.append_valid\(|\bstore\.append\(")
    offenders = [p.name for p in PACKAGE_DIR.glob("*.py")
                 if p.name != "report.py" and calls.search(p.read_text())]
    assert offenders == []
