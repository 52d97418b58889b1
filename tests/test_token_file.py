"""Bearer tokens from files, for the agent and the collector ([robust] #10): a file that is missing,
binary or empty is a usage error (exit 2, one line), never a collector without authentication; a
token file others can read is warned about; the collector wants the `Bearer ` scheme, as the agent."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import structlog
from live_chain import free_port, http_ok, wait_until

from gputrace.errors import UsageError
from gputrace.token_file import read_token


@pytest.mark.parametrize(("content", "what"), [(None, "cannot read it"), (b"\xff\xfe\x00", "not a text file"),
                                               (b"  \n", "the file is empty")])
def test_an_unusable_token_file_is_a_usage_error(tmp_path: Path, content: bytes | None, what: str) -> None:
    """Missing, binary and empty token files are refused with the flag and the file named."""
    path = tmp_path / "token"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(UsageError, match=f"--token-file {path}: {what}"):
        read_token(str(path))


def test_a_token_file_others_can_read_is_warned_about(tmp_path: Path) -> None:
    """The token is read; a file readable by group or others gives one warning with the fix."""
    path = tmp_path / "token"
    path.write_text("s3cret\n")
    path.chmod(0o600)
    with structlog.testing.capture_logs() as quiet:
        assert read_token(str(path)) == "s3cret"
    path.chmod(0o644)
    with structlog.testing.capture_logs() as logs:
        assert read_token(str(path)) == "s3cret"
    assert not quiet
    assert [e["event"] for e in logs] == ["token file readable by other users"]
    assert logs[0]["fix"] == f"chmod 600 {path}"


@pytest.mark.parametrize("command", ["collect", "agent"])
def test_the_commands_refuse_an_empty_token_file_in_one_line(tmp_path: Path, command: str) -> None:
    """`collect` and `agent` with an empty --token-file exit 2 with one line (the collector ran
    without authentication)."""
    token = tmp_path / "token"
    token.write_text("")
    cfg = tmp_path / "gputrace.toml"
    cfg.write_text('[[hosts]]\nname = "h"\n')
    args = {"collect": ["collect", "--config", str(cfg), "--out", str(tmp_path / "run")],
            "agent": ["agent", "--backend", "sim"]}[command]
    out = subprocess.run([sys.executable, "-m", "gputrace", *args, "--token-file", str(token)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip() == f"gputrace: error: --token-file {token}: the file is empty"


def test_the_collector_wants_the_bearer_scheme(tmp_path: Path) -> None:
    """The collector's endpoints answer a request with `Authorization: Bearer <token>` and refuse
    the bare token, as the agent does."""
    token = tmp_path / "token"
    token.write_text("s3cret")
    token.chmod(0o600)
    cfg = tmp_path / "gputrace.toml"
    cfg.write_text('[[hosts]]\nname = "h"\n')
    port = free_port()
    argv = [sys.executable, "-m", "gputrace", "collect", "--config", str(cfg), "--out", str(tmp_path / "run"),
            "--listen", f"127.0.0.1:{port}", "--token-file", str(token)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}/v1/status"

        def status(header: str | None) -> int:
            req = urllib.request.Request(url, headers={"Authorization": header} if header else {})
            try:
                with urllib.request.urlopen(req, timeout=5) as resp:
                    json.loads(resp.read())
                    return int(resp.status)
            except urllib.error.HTTPError as exc:
                return int(exc.code)
            except OSError:
                return 0

        wait_until(lambda: status("Bearer s3cret") == 200, timeout_s=30)
        assert [status(h) for h in (None, "s3cret", "Bearer wrong")] == [401] * 3
        assert not http_ok(url)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.parametrize(("content", "what"), [(None, "cannot read it: No such file or directory"),
                                               (b"\xff\xfe\x00", "not a text file")])
def test_the_collector_refuses_a_missing_or_binary_token_file_in_one_line(
        tmp_path: Path, content: bytes | None, what: str) -> None:
    """`collect --token-file` with a file not there or not text exits 2 with one line and leaves
    no run (were 'unexpected FileNotFoundError' and 'UnicodeDecodeError')."""
    token = tmp_path / "token"
    if content is not None:
        token.write_bytes(content)
    cfg = tmp_path / "gputrace.toml"
    cfg.write_text('[[hosts]]\nname = "h"\n')
    out = subprocess.run([sys.executable, "-m", "gputrace", "collect", "--config", str(cfg), "--out",
                          str(tmp_path / "run"), "--token-file", str(token)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip() == f"gputrace: error: --token-file {token}: {what}"
    assert not (tmp_path / "run").exists()


def test_the_collector_open_beyond_loopback_with_insecure_is_warned_about(tmp_path: Path) -> None:
    """`collect --listen 0.0.0.0:PORT --insecure` serves, and logs one warning that anyone who
    reaches the port can post marks ([robust] #10: nothing was said)."""
    cfg = tmp_path / "gputrace.toml"
    cfg.write_text('[[hosts]]\nname = "h"\n')
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "gputrace", "--log-format", "json", "collect", "--config",
                             str(cfg), "--out", str(tmp_path / "run"), "--listen", f"0.0.0.0:{port}",
                             "--insecure"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: http_ok(f"http://127.0.0.1:{port}/healthz"), timeout_s=30)
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-2000:]
    events = [json.loads(line) for line in err.splitlines() if line.startswith("{")]  # then "run written to"
    warnings = [e for e in events if e.get("level") == "warning"]
    assert [e["event"] for e in warnings] == [
        "collector endpoints open to the network without authentication (--insecure): "
        "anyone who reaches the port can post marks"]
