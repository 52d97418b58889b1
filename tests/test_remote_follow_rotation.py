"""[robust] #45: the loss classes of following a log through rotation (the scenarios of
loss_classes.py, also run by bench/robust.py), over a real sshd, rotated by the real `logrotate`.
Each counted against the lines written: nothing lost, nothing twice; where the file is gone, the
gap recorded."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from live_chain import free_port, get_json, http_ok, wait_until
from loss_classes import (
    Engine,
    command_log_rewritten_in_an_outage,
    copytruncate_after_each_burst,
    copytruncate_mid_read,
    gone_in_an_outage_while_behind,
    logrotate,
    new_inode_in_an_outage,
    renamed_while_python_logging_writes,
    two_copytruncates_in_one_outage,
    written_between_copy_and_truncation,
)
from sshd import SshServer, sshd_server_fixture  # noqa: F401

from gputrace.store import Store

pytestmark = pytest.mark.system


async def test_two_copytruncates_during_one_outage_lose_nothing(sshd_server: SshServer,
                                                                tmp_path: Path) -> None:
    """Class 1: sshd down; logrotate copytruncate twice (the first copy becomes server.log.2, the
    second server.log.1); sshd back: both copies are read on, in order, then the live file
    (before: the lines only in server.log.1 were lost, 245 of 2,688), and no gap is recorded: the
    engine writes nothing between logrotate's copy and its truncation (before: a 'lines between the
    copy and the truncation, if any, are lost' gap of unknown size; one is recorded now only where
    the copy is shorter than the file was seen, with the bytes it lacks)."""
    outcome = await two_copytruncates_in_one_outage(sshd_server, tmp_path)
    assert outcome.tested, "no server.log.2: the test did not test what it says"
    assert (outcome.lost, outcome.doubled) == (0, 0)
    assert outcome.got == outcome.written
    assert outcome.gaps == [], outcome.summary()


async def test_copytruncate_after_each_burst_with_the_follower_behind(sshd_server: SshServer,
                                                                     tmp_path: Path) -> None:
    """Class 1, live: three bursts of 40,000 lines, each followed at once by logrotate copytruncate
    while the follower is still reading the first (before: 220,000 of 360,000 lost)."""
    outcome = await copytruncate_after_each_burst(sshd_server, tmp_path)
    assert outcome.tested, "the follower kept up: the test did not test what it says"
    assert (outcome.lost, outcome.doubled) == (0, 0)
    assert outcome.got == outcome.written


async def test_lines_written_between_the_copy_and_the_truncation_are_recorded_with_their_size(
        sshd_server: SshServer, tmp_path: Path) -> None:
    """Class 1, a real loss: the follower mid-read of a 12 MB burst; the log copied, 100 lines
    written (the follower sees the file grow), the log truncated: those 100 lines are in no file.
    The copy is read to its end, then the new content; one gap is recorded, at the copy's end, with
    the 100 lines' bytes (before: 'if any, are lost', size unknown)."""
    outcome = await written_between_copy_and_truncation(sshd_server, tmp_path)
    assert outcome.tested, "the follower had read the burst already: the test did not test what it says"
    assert outcome.got == outcome.expected and (outcome.lost, outcome.doubled) == (100, 0)
    assert [g.lost_bytes for g in outcome.gaps] == [outcome.gone_bytes], outcome.summary()
    assert outcome.gaps[0].after_byte == (tmp_path / "server.log.1").stat().st_size


@pytest.mark.parametrize("case", ["truncated", "restarted", "shorter"])
async def test_a_command_source_whose_log_is_rewritten_during_an_outage(
        sshd_server: SshServer, tmp_path: Path, case: str) -> None:
    """Class 2: a command source (`tail -n +1 -f`, as `kubectl logs -f`) whose log was truncated
    and rewritten during an SSH outage. The rerun is matched by content against the lines read:
    the new log is read from where it differs (all of it, or past the banner it shares; `shorter`:
    decided once its output stopped short), and the gap (the old output's lines past the last one
    read: here the 50 written during the outage) is recorded with its line and time span (before:
    the rerun's first lines were skipped by the old line count, 1,170 of 2,596 lost, nothing said)."""
    outcome = await command_log_rewritten_in_an_outage(sshd_server, tmp_path, case)
    assert outcome.got == outcome.expected
    assert outcome.lost == 50
    gaps = outcome.gaps
    assert [(g.where, g.after_line) for g in gaps] == [(f"tail -n +1 -f {tmp_path / 'server.log'}", 300)]
    assert gaps[0].since_ns is not None and gaps[0].found_ns > gaps[0].since_ns
    assert ("read from its start" if case == "truncated" else "read from line 11") in gaps[0].reason


@pytest.mark.parametrize("rotation", ["create-compress", "replaced", "removed"])
async def test_a_new_inode_during_an_outage(sshd_server: SshServer, tmp_path: Path, rotation: str) -> None:
    """Class 3: during an outage the log is renamed and gzipped (logrotate create + compress), or
    replaced by a copy (a new inode holding the same content), or rotated and the old file removed:
    the first two lose nothing (read on from the .gz, from the new file at the old offset); the
    third records the gap (the byte it begins at, its time span) in what the follower reports
    (before: 245 lost, said only on stderr)."""
    outcome = await new_inode_in_an_outage(sshd_server, tmp_path, rotation)
    assert outcome.tested and outcome.doubled == 0
    if rotation != "removed":
        assert outcome.lost == 0 and outcome.gaps == []
        assert outcome.got == outcome.written
        return
    # every line lost was in the removed file, unread
    assert outcome.lost > 20 and set(outcome.expected) <= set(outcome.got)
    gaps = outcome.gaps
    assert len(gaps) == 1 and gaps[0].after_byte is not None and gaps[0].after_byte > 0
    assert gaps[0].since_ns is not None and gaps[0].found_ns - gaps[0].since_ns > 0.5e9
    assert "rotated away" in gaps[0].reason


@pytest.mark.parametrize("how", ["removed", "truncated"])
async def test_a_file_gone_in_an_outage_records_the_size_it_was_seen_at(
        sshd_server: SshServer, tmp_path: Path, how: str) -> None:
    """Class 3, the follower behind: it is mid-read of a 12 MB burst when sshd goes down; in the
    outage the rotated file is removed, or the file truncated in place with no copy. The gap is
    recorded with its size: the bytes the file held past the offset when the follower last looked
    (here all of the burst's unread rest: nothing was written after), and the lines after it are
    read (before: 'size unknown')."""
    outcome = await gone_in_an_outage_while_behind(sshd_server, tmp_path, how)
    assert outcome.tested, "the follower had read the burst already: the test did not test what it says"
    assert outcome.got == outcome.expected and outcome.lost > 1_000
    assert [(g.after_byte is not None, g.lost_bytes) for g in outcome.gaps] == [
        (True, outcome.gone_bytes)], outcome.summary()


async def test_renamed_while_python_logging_keeps_writing_to_it(sshd_server: SshServer,
                                                               tmp_path: Path) -> None:
    """Class 6: Python's logging.FileHandler keeps its file open; logrotate (create, no
    copytruncate) renames it twice: every line is still written to the renamed file and read
    from it (before: 4,833 of 5,758 lost), and no gap is recorded (before the fix of the empty
    file created by the first rotation, renamed by the second, the reconnect recorded a gap at its
    byte 0: nothing was lost)."""
    outcome = await renamed_while_python_logging_writes(sshd_server, tmp_path)
    assert outcome.tested, "server.log not renamed twice: the test did not test what it says"
    assert (outcome.lost, outcome.doubled) == (0, 0)
    assert outcome.got == outcome.written
    assert outcome.gaps == [], outcome.summary()


async def test_copytruncate_while_the_follower_is_mid_read(sshd_server: SshServer, tmp_path: Path) -> None:
    """Class 5: a 15 MB burst; logrotate copytruncate while the follower is still reading it; a
    second burst regrows the file past the follower's offset: the rest of the first is read from
    the copy, the second from its start (before: 100,841 of 121,000 lost, the regrown file read as
    if it continued the old one)."""
    outcome = await copytruncate_mid_read(sshd_server, tmp_path)
    assert outcome.tested, "the follower had read the burst already: the test did not test what it says"
    assert (outcome.lost, outcome.doubled) == (0, 0)
    assert outcome.got == outcome.written


def log_lines(port: int) -> int:
    """The log lines `gputrace collect` listening on ``port`` has received."""
    counts = get_json(f"http://127.0.0.1:{port}/v1/status")["counts"]
    assert isinstance(counts, dict)
    return int(counts["log_lines"])


def test_collect_records_a_removed_rotated_file_in_meta_json(sshd_server: SshServer, tmp_path: Path) -> None:
    """Class 3 as users run it: `gputrace collect` over SSH; during an outage the log is rotated
    (logrotate create) and the rotated file removed before it was read to its end: meta.json's
    log_gaps names the file, the byte the gap begins at and its time span, and source_problems
    carries it to the report (before: only a warning on stderr)."""
    path = tmp_path / "server.log"
    engine = Engine(path)
    engine.start()
    cfg = tmp_path / "gputrace.toml"
    cfg.write_text(f'[[hosts]]\nname = "node0"\nssh = "root@127.0.0.1:{sshd_server.port}"\n'
                   f'identity_file = "{sshd_server.client_key_path}"\n'
                   f'known_hosts = "{sshd_server.known_hosts_path}"\n'
                   f'[hosts.log]\nkind = "file"\npath = {json.dumps(str(path))}\n')
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "gputrace", "collect", "--config", str(cfg), "--out",
                             str(tmp_path / "run"), "--listen", f"127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_until(lambda: http_ok(f"http://127.0.0.1:{port}/healthz"), timeout_s=60)
        # the follower has read the file (a loaded machine took over a second to start it: with
        # nothing read, the collector knew no file to miss)
        wait_until(lambda: log_lines(port) > 50, timeout_s=60)
        sshd_server.kill()
        time.sleep(0.5)
        with engine.lock:
            logrotate(tmp_path, path, "create")
            (tmp_path / "server.log.1").unlink()
            engine.reopen()
        time.sleep(0.5)
        read_by_then = log_lines(port)
        sshd_server.restart()
        # reconnected (its back-off may be seconds after the outage): lines written since arrive
        wait_until(lambda: log_lines(port) > read_by_then + 20, timeout_s=60)
    finally:
        engine.stop_event.set()
        engine.join()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err.decode()[-2000:]
    with Store.open(tmp_path / "run", read_only=True) as store:
        collector = store.meta.extra["collector"]
    gaps = collector["log_gaps"]
    assert len(gaps) == 1 and gaps[0]["source"] == "log node0" and gaps[0]["after_byte"] > 0
    assert gaps[0]["found_ns"] - gaps[0]["since_ns"] > 0.5e9
    assert any("rotated away" in p["reason"] and p["since_ns"] == gaps[0]["since_ns"]
               for p in collector["source_problems"])

