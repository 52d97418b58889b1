"""numpy arrays and plain Python lists -> Arrow arrays without ``pa.array``, whose first call
imports pandas only to ask whether it was given a pandas object: 0.25 CPU s, a tenth of what
`gputrace import` spends on a 160 MB log, and more than it spends reading a small one. The
columns built here wrap numpy's buffers (no copy); values of any other kind go to ``pa.array``,
which checks and converts them as before."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa

# Arrow type -> (the Python type its plain values have, numpy dtype, the fill under a NULL)
_PLAIN: dict[pa.DataType, tuple[type, type, Any]] = {
    pa.int64(): (int, np.int64, 0),
    pa.float64(): (float, np.float64, 0.0),
    pa.bool_(): (bool, np.bool_, False),
}


def _validity(mask: np.ndarray | None) -> tuple[pa.Buffer | None, int]:
    """Arrow's validity bitmap (bit set = a value) for ``mask`` (True = NULL), and the NULLs."""
    if mask is None:
        return None, 0
    null_count = int(np.count_nonzero(mask))
    if not null_count:
        return None, 0
    return pa.py_buffer(np.packbits(~mask, bitorder="little")), null_count


def from_numpy(values: np.ndarray, mask: np.ndarray | None = None) -> pa.Array:
    """``values`` (1-D, bool or numeric) as an Arrow array, NULL where ``mask`` is True."""
    values = np.ascontiguousarray(values)
    validity, null_count = _validity(mask)
    if values.dtype == np.bool_:
        data = pa.py_buffer(np.packbits(values, bitorder="little"))
        arrow_type = pa.bool_()
    else:
        data = pa.py_buffer(values)
        arrow_type = pa.from_numpy_dtype(values.dtype)
    return pa.Array.from_buffers(arrow_type, len(values), [validity, data], null_count=null_count)


def strings(texts: Sequence[str | None]) -> pa.Array:
    """``texts`` as an Arrow string array, NULL where None."""
    mask = np.fromiter((t is None for t in texts), dtype=bool, count=len(texts))
    encoded = [b"" if t is None else t.encode() for t in texts]
    offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded)), out=offsets[1:])
    validity, null_count = _validity(mask)
    # 32-bit offsets as the string type has (no cast: casting imports pyarrow.compute, 0.1 s)
    wide = offsets[-1] >= 2**31
    return pa.Array.from_buffers(pa.large_string() if wide else pa.string(), len(texts),
                                 [validity, pa.py_buffer(offsets if wide else offsets.astype(np.int32)),
                                  pa.py_buffer(b"".join(encoded))], null_count=null_count)


def from_values(values: Sequence[Any], dtype: pa.DataType) -> pa.Array:
    """A list of plain values of ``dtype`` (int, float, bool, str, or None) as an Arrow array;
    anything else (an int in a float column, a value out of range) through ``pa.array``."""
    if dtype == pa.string():
        if all(type(v) is str or v is None for v in values):
            try:
                return strings(values)
            except UnicodeEncodeError:  # a lone surrogate: pa.array says what it says of it
                pass
        return pa.array(values, type=dtype)
    plain = _PLAIN.get(dtype)
    if plain is None:
        return pa.array(values, type=dtype)
    py_type, np_type, fill = plain
    if not all(type(v) is py_type or v is None for v in values):
        return pa.array(values, type=dtype)
    mask = np.fromiter((v is None for v in values), dtype=bool, count=len(values))
    try:
        filled: np.ndarray = np.array([fill if v is None else v for v in values], dtype=np_type)
    except OverflowError:  # beyond int64: pa.array raises the error the store maps
        return pa.array(values, type=dtype)
    return from_numpy(filled, mask)


def numbers(array: pa.Array) -> np.ndarray:
    """An int64 or float64 array without NULLs as numpy: a view of its buffer (``to_numpy``
    probes pandas)."""
    dtypes = {pa.int64(): np.int64, pa.float64(): np.float64}
    if array.type not in dtypes or array.null_count:
        raise ValueError(f"not an int64 or float64 array without NULLs: {array.type}, "
                         f"{array.null_count} NULLs")
    values: np.ndarray = np.frombuffer(array.buffers()[1], dtype=dtypes[array.type], count=len(array),
                                       offset=8 * array.offset)
    return values
