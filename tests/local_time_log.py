"""An engine that logs in local time, as SGLang does (Python logging's ``%(asctime)s``, which is
``time.localtime``), run as its own process with ``TZ`` set: the stamps are the zone's, as on a
host whose clock is set to it. Each line's true time (``record.created``, seconds since the epoch)
is printed on stdout, one a line, for the tests to compare the stored stamps with.

    python tests/local_time_log.py PATH LINES PERIOD_S     (TZ=Etc/GMT-2 in its environment)
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path


def start(path: Path, lines: int, period_s: float, tz: str) -> subprocess.Popen[str]:
    """The writer for ``lines`` lines, one every ``period_s``, stamped in zone ``tz``."""
    return subprocess.Popen([sys.executable, __file__, str(path), str(lines), str(period_s)],
                            env={**os.environ, "TZ": tz}, stdout=subprocess.PIPE, text=True)


def true_times_s(proc: subprocess.Popen[str], timeout_s: float = 120.0) -> list[float]:
    """Wait for the writer to end; the true time of each line it wrote."""
    out, _ = proc.communicate(timeout=timeout_s)
    assert proc.returncode == 0
    return [float(t) for t in out.split()]


class _TellCreated(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        print(repr(record.created), flush=True)
        return True


def main(path: str, lines: int, period_s: float) -> None:
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("[%(asctime)s PP%(pp)d] %(message)s", datefmt="%Y-%m-%d %H:%M:%S"))
    handler.addFilter(_TellCreated())
    logger = logging.getLogger("engine")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    for i in range(lines):
        logger.info("Decode batch, #running-req: 8, #token: %d, token usage: 0.05, cuda graph: True, "
                    "gen throughput (token/s): 250.00, #queue-req: 24", i, extra={"pp": i % 8})
        time.sleep(period_s)
    handler.close()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]))
