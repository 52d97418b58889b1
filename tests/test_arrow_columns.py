"""gputrace.arrow_columns builds the arrays ``pa.array`` builds, without importing pandas."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from gputrace.arrow_columns import from_numpy, from_values, numbers, strings

CASES = [
    ([1, None, -3, 2**62], pa.int64()),
    ([0.5, None, float("nan"), -1e300], pa.float64()),
    ([True, None, False, True, False, False, True, True, False], pa.bool_()),
    (["decode", None, "", "Ünïcode ✓"], pa.string()),
    ([None, None], pa.int64()),
    ([], pa.float64()),
    ([1, 2.5], pa.float64()),  # an int in a float column: pa.array's own conversion
    ([1.5], pa.int64()),  # a float in an int column: pa.array decides
]


@pytest.mark.parametrize(("values", "dtype"), CASES, ids=[f"{d}-{i}" for i, (_, d) in enumerate(CASES)])
def test_from_values_equals_pa_array(values: list[object], dtype: pa.DataType) -> None:
    """Lists of plain values (None for NULL) give what ``pa.array`` gives, NULLs and NaN alike."""
    expected = pa.array(values, type=dtype)
    got = from_values(values, dtype)
    assert got.type == expected.type and got.null_count == expected.null_count
    assert [repr(v) for v in got.to_pylist()] == [repr(v) for v in expected.to_pylist()]  # NaN too


@pytest.mark.parametrize(("values", "dtype"), [([2**64], pa.int64()), (["\udc80"], pa.string()),
                                               ([True, 1], pa.int64())])
def test_from_values_rejects_what_pa_array_rejects(values: list[object], dtype: pa.DataType) -> None:
    """A value the column cannot hold raises pa.array's own error (the store maps it)."""
    with pytest.raises(Exception) as expected:  # whichever pa.array raises
        pa.array(values, type=dtype)
    with pytest.raises(type(expected.value)):
        from_values(values, dtype)


def test_from_numpy_masks_and_packs() -> None:
    """numpy values and a NULL mask give pa.array's array; bools are bit-packed; a slice reads back."""
    rng = np.random.default_rng(0)
    for values in (rng.integers(-5, 5, 37), rng.random(37), rng.random(37) < 0.5):
        mask = rng.random(37) < 0.3
        assert from_numpy(values, mask).equals(pa.array(values, mask=mask))
        assert from_numpy(values).equals(pa.array(values))
    ints = from_numpy(np.arange(10, dtype=np.int64))
    assert numbers(ints.slice(3, 4)).tolist() == [3, 4, 5, 6]
    assert strings(["a", "bc"]).equals(pa.array(["a", "bc"]))


def test_import_of_an_engine_log_loads_neither_pandas_nor_arrow_compute(tmp_path: Path) -> None:
    """`gputrace import` of an SGLang log (fast-path rows, per-line rows, configuration records)
    imports neither pandas (pyarrow's pa.array did on its first call: 0.25 CPU s of every import)
    nor pyarrow.compute (a cast did: 0.1 s of docstrings built at its import)."""
    log = tmp_path / "sglang.log"
    log.write_text(
        "[2026-06-24 00:00:00 PP0] max_total_num_tokens=1048576, chunked_prefill_size=8192, "
        "max_prefill_tokens=16384, max_running_requests=64, context_len=131072\n"
        "[2026-06-24 00:00:01 PP0] Decode batch, #running-req: 8, #token: 4000, token usage: 0.01, "
        "cuda graph: True, gen throughput (token/s): 300.00, #queue-req: 2\n"
        "[2026-06-24 00:00:02 PP1] Decode batch. #running-req: 8, #token: 4000, token usage: 0.01, "
        "gen throughput (token/s): 300.00, #queue-req: 2\n")
    program = ("import sys\n"
               "from gputrace.cli import main\n"
               "try:\n"
               "    main(['import', '--run', sys.argv[1], '--sglang-log', sys.argv[2]])\n"
               "except SystemExit as exc:\n"
               "    assert not exc.code, exc.code\n"
               "print('pandas' in sys.modules, 'pyarrow.compute' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", program, str(tmp_path / "run"), str(log)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "2 events, 1 configuration records" in done.stdout
    assert done.stdout.strip().endswith("False False"), done.stdout
