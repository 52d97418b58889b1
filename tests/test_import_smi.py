"""nvidia-smi importers into a real run store.

Fixtures in tests/import_data/ follow nvidia-smi's real output:
- nvidia_smi_query.csv: ``nvidia-smi --query-gpu=timestamp,index,pci.bus_id,utilization.gpu,
  utilization.memory,power.draw,clocks.sm,clocks.mem,memory.used,memory.total,temperature.gpu,
  clocks_event_reasons.active --format=csv -lms 100``: a header of field names with "[unit]",
  values with units ("87 %", "604.50 W", "71234 MiB"), "[N/A]" for an unsupported value,
  timestamps "YYYY/MM/DD HH:MM:SS.mmm" in the host's local time (layout as in nvidia-smi's man page
  section "--format=csv" and captured -lms output such as "2024/01/16 14:44:16.977, P8, 25, 0 %,
  0 %, 23028 MiB"); the last row is cut short as a killed nvidia-smi leaves it.
- nvidia_smi_query_noheader_nounits.csv: ``--query-gpu=index,timestamp,power.draw,utilization.gpu,
  memory.used --format=csv,noheader,nounits``: another field order, no header, bare numbers.
- nvidia_smi_dmon_dt.txt: ``nvidia-smi dmon -s pucvmet -o DT``: "#Date Time gpu pwr gtemp ..."
  header and "#YYYYMMDD HH:MM:SS Idx W C ..." units line, repeated as dmon repeats them, "-" for
  unsupported metrics (columns as in the man page's dmon section and captured outputs such as
  "#Date Time gpu fb bar1 ccpm sm mem enc dec jpg ofa rxpci txpci mclk pclk").
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest
from helpers import gputrace_process

from gputrace.errors import ConfigError
from gputrace.imports.nvidia_smi import (
    import_nvidia_smi_csv,
    import_nvidia_smi_dmon,
    parse_dmon,
    parse_query_csv,
    parse_tz,
)
from gputrace.model import GpuSample
from gputrace.store import Store

DATA = Path(__file__).parent / "import_data"


def _epoch_ns(text: str, tz: dt.tzinfo = dt.UTC) -> int:
    stamp = dt.datetime.strptime(text, "%Y-%m-%d %H:%M:%S.%f").replace(tzinfo=tz)
    return int(stamp.timestamp()) * 1_000_000_000 + stamp.microsecond * 1000


def test_query_csv_with_header_and_units(tmp_path: Path) -> None:
    """Header order, units stripped and converted, [N/A] is None, the cut row counted."""
    with Store.create(tmp_path / "run") as store:
        result = import_nvidia_smi_csv(store, DATA / "nvidia_smi_query.csv", host="gpu-node-1")
        samples = sorted(store.records(GpuSample), key=lambda s: (s.ts_ns, s.gpu_index))
    assert result.written["gpu_samples"] == 8 and result.bad == 1
    assert "row 10" in result.problems[0] and "4 fields, expected 12" in result.problems[0]
    s0 = samples[0]
    assert s0.host == "gpu-node-1" and s0.gpu_index == 0
    assert s0.ts_ns == _epoch_ns("2024-01-16 14:44:16.977")
    assert s0.utilization_ratio == pytest.approx(0.87) and s0.memory_utilization_ratio == pytest.approx(0.43)
    assert s0.power_w == pytest.approx(604.5)
    assert s0.sm_clock_hz == 1980e6 and s0.memory_clock_hz == 2619e6
    assert s0.memory_used_bytes == 71234 * 2**20 and s0.memory_total_bytes == 81559 * 2**20
    assert s0.temperature_c == 55 and s0.clock_event_reasons == 0
    assert samples[1].gpu_index == 1 and samples[1].clock_event_reasons == 1
    na = [s for s in samples if s.gpu_index == 1 and s.utilization_ratio == pytest.approx(0.88)]
    assert len(na) == 1 and na[0].power_w is None and na[0].temperature_c == 56
    gpu0 = [s.utilization_ratio for s in samples if s.gpu_index == 0]
    assert gpu0 == pytest.approx([0.87, 0.91, 0.45, 1.0])


def test_query_csv_noheader_nounits_needs_fields() -> None:
    """noheader output takes its field order from the query list; without it, one clear error."""
    fields = ["index", "timestamp", "power.draw", "utilization.gpu", "memory.used"]
    tz = parse_tz("+08:00")
    parsed = parse_query_csv(DATA / "nvidia_smi_query_noheader_nounits.csv", "n2", fields=fields, tz=tz)
    samples = [s for s in parsed.records if isinstance(s, GpuSample)]
    assert parsed.bad == 0 and len(samples) == 6
    last = samples[-1]
    assert last.gpu_index == 1 and last.power_w == pytest.approx(251.5)
    assert last.utilization_ratio == pytest.approx(0.41) and last.memory_used_bytes == 2000 * 2**20
    assert last.ts_ns == _epoch_ns("2024-01-16 14:45:02.101", tz)
    assert last.ts_ns == _epoch_ns("2024-01-16 06:45:02.101")  # +08:00 local is 8 h ahead of UTC
    with pytest.raises(ConfigError, match="field list"):
        parse_query_csv(DATA / "nvidia_smi_query_noheader_nounits.csv", "n2")


def test_query_csv_needs_timestamp(tmp_path: Path) -> None:
    """A query without the timestamp field cannot be placed in time: one line says so."""
    path = tmp_path / "q.csv"
    path.write_text("index, utilization.gpu [%]\n0, 50 %\n")
    with pytest.raises(ConfigError, match="no 'timestamp' field"):
        parse_query_csv(path, "h")


def test_dmon_dt(tmp_path: Path) -> None:
    """dmon -o DT: repeated headers skipped, '-' is None, units converted, the short row counted."""
    with Store.create(tmp_path / "run") as store:
        result = import_nvidia_smi_dmon(store, DATA / "nvidia_smi_dmon_dt.txt", host="gpu-node-2")
        samples = sorted(store.records(GpuSample), key=lambda s: (s.ts_ns, s.gpu_index))
    assert result.written["gpu_samples"] == 10 and result.bad == 1
    assert "4 columns, expected 24" in result.problems[0]
    s0 = samples[0]
    assert s0.ts_ns == _epoch_ns("2024-01-04 13:54:35.000") and s0.gpu_index == 0
    assert s0.power_w == 590 and s0.temperature_c == 50 and s0.utilization_ratio == pytest.approx(0.95)
    assert s0.memory_utilization_ratio == pytest.approx(0.31)
    assert s0.sm_clock_hz == 1980e6 and s0.memory_clock_hz == 2619e6
    assert s0.memory_used_bytes == 70000 * 2**20
    assert s0.pcie_rx_bytes_per_s == 217e6 and s0.pcie_tx_bytes_per_s == 677e6
    gpu1 = [s.utilization_ratio for s in samples if s.gpu_index == 1]
    assert gpu1 == pytest.approx([0.12, 0.70, 0.66, 0.0, 0.40])


def test_dmon_without_dates_is_rejected(tmp_path: Path) -> None:
    """dmon recorded without -o DT has no dates: one line tells how to record it."""
    path = tmp_path / "dmon.txt"
    path.write_text("# gpu    pwr  gtemp     sm\n# Idx      W      C      %\n    0     72     34      0\n")
    with pytest.raises(ConfigError, match="-o DT"):
        parse_dmon(path, "h")


@pytest.mark.parametrize(
    ("which", "wrong"),
    [
        ("csv", "nvidia_smi_dmon_dt.txt"),
        ("dmon", "nvidia_smi_query.csv"),
        ("csv", "aiperf_profile_export.jsonl"),
    ],
)
def test_wrong_file_type(which: str, wrong: str) -> None:
    """Another tool's file given to an nvidia-smi importer is a one-line ConfigError."""
    with pytest.raises(ConfigError) as info:
        if which == "csv":
            parse_query_csv(DATA / wrong, "h")
        else:
            parse_dmon(DATA / wrong, "h")
    assert "\n" not in str(info.value) and wrong in str(info.value)


def test_parse_tz() -> None:
    """Time zones: UTC by default, fixed offsets, IANA names; nonsense is a usage error."""
    assert parse_tz(None) is dt.UTC
    assert parse_tz("-05:30").utcoffset(None) == -dt.timedelta(hours=5, minutes=30)
    assert parse_tz("Europe/Berlin").utcoffset(dt.datetime(2024, 1, 1)) == dt.timedelta(hours=1)
    with pytest.raises(ConfigError):
        parse_tz("Mars/Olympus")


def test_a_row_with_a_value_no_column_holds_is_one_bad_row(tmp_path: Path) -> None:
    """An nvidia-smi CSV row whose GPU index is 2^63 is skipped with the reason; the other rows
    are imported ([robust] #3: 0 rows and `unexpected OverflowError` before)."""
    lines = (DATA / "nvidia_smi_query.csv").read_text().splitlines()
    header, first, second = lines[0], lines[1], lines[2]
    index_at = [c.strip() for c in header.split(",")].index("index")
    cells = first.split(",")
    cells[index_at] = " 9223372036854775808"
    csv = tmp_path / "smi.csv"
    csv.write_text("\n".join([header, ",".join(cells), second]) + "\n")
    with Store.create(tmp_path / "run") as store:
        result = import_nvidia_smi_csv(store, csv, host="gpu-node-1")
        assert store.count("gpu_samples") == 1
    assert result.written["gpu_samples"] == 1 and result.bad == 1
    assert "cannot be stored: gpu_index=9223372036854775808" in result.problems[0]


def _imported_samples(run: Path, csv_path: Path) -> list[GpuSample]:
    """`gputrace import --nvidia-smi-csv` run as a user runs it; the samples stored."""
    proc = gputrace_process("import", "--run", str(run), "--nvidia-smi-csv", str(csv_path))
    assert proc.returncode == 0, proc.stderr
    with Store.open(run, read_only=True) as store:
        return sorted(store.records(GpuSample), key=lambda s: (s.ts_ns, s.gpu_index))


def _without_host(samples: list[GpuSample]) -> list[tuple[object, ...]]:
    return [(s.gpu_index, s.ts_ns, s.power_w, s.sm_clock_hz, s.memory_clock_hz, s.memory_used_bytes,
             s.memory_total_bytes, s.utilization_ratio) for s in samples]


def test_units_other_than_nvidia_smis_own_are_converted(tmp_path: Path) -> None:
    """mW, GHz and KiB (in the header, or on each value) were stored as W, MHz and MiB: read from
    the header or the value and converted, the samples equal those of the W/MHz/MiB capture."""
    header, *rows = (DATA / "nvidia_smi_query.csv").read_text().splitlines()
    scaled_header = (header.replace("power.draw [W]", "power.draw [mW]")
                     .replace("clocks.current.sm [MHz]", "clocks.current.sm [GHz]")
                     .replace("memory.used [MiB]", "memory.used [KiB]"))
    scaled_rows = []
    for row in rows:
        cells = row.split(", ")
        if len(cells) == 12:  # the cut last row stays as it is
            for i, (unit, factor) in {5: ("mW", 1000), 6: ("GHz", 1e-3), 8: ("KiB", 1024)}.items():
                number, _, _ = cells[i].partition(" ")
                if number[:1].isdigit():
                    cells[i] = f"{float(number) * factor:g} {unit}" if i != 8 else f"{int(number) * factor}"
        scaled_rows.append(", ".join(cells))
    scaled = tmp_path / "scaled.csv"
    scaled.write_text("\n".join([scaled_header, *scaled_rows]) + "\n")
    expected = _imported_samples(tmp_path / "plain", DATA / "nvidia_smi_query.csv")
    got = _imported_samples(tmp_path / "scaled", scaled)
    assert len(got) == 8 and got[0].power_w == pytest.approx(604.5)
    assert got[0].sm_clock_hz == pytest.approx(1.98e9) and got[0].memory_used_bytes == 71234 * 2**20
    for mine, theirs in zip(_without_host(got), _without_host(expected), strict=True):
        assert mine == pytest.approx(theirs)


@pytest.mark.parametrize(("header", "unit"), [("power.draw [dBm]", "dBm"), ("memory.used [MB/s]", "MB/s")])
def test_a_unit_gputrace_cannot_convert_is_refused_in_one_line(tmp_path: Path, header: str,
                                                               unit: str) -> None:
    """A header unit with no conversion is one error line naming the column, exit 2, no run left."""
    path = tmp_path / "q.csv"
    path.write_text(f"timestamp, index, {header}\n2024/01/16 14:44:16.977, 0, 5\n")
    proc = gputrace_process("import", "--run", str(tmp_path / "run"), "--nvidia-smi-csv", str(path))
    assert proc.returncode == 2
    (line,) = proc.stderr.splitlines()
    assert line.startswith(f"gputrace: error: {path}: column {header!r}: unit {unit!r} not understood "
                           "(expected ")
    assert not (tmp_path / "run").exists()


def test_a_csv_with_a_byte_order_mark_imports_as_without(tmp_path: Path) -> None:
    """Excel's and PowerShell's UTF-8 byte-order mark made the first column 'no timestamp field':
    it is dropped, and every row is imported."""
    bom = tmp_path / "bom.csv"
    bom.write_bytes(b"\xef\xbb\xbf" + (DATA / "nvidia_smi_query.csv").read_bytes())
    got = _imported_samples(tmp_path / "bom", bom)
    plain = _imported_samples(tmp_path / "plain", DATA / "nvidia_smi_query.csv")
    assert _without_host(got) == _without_host(plain)
    assert len(got) == 8
