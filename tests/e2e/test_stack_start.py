"""A child of `Stack` that does not start says why in the exception: its log lives in the
stack's temporary directory, removed as the failed start cleans up, so the exception carries
the log's last lines (a replica that exited 1 in about one CI run in five left nothing else
to read)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from extproc.stack import Stack, StackOptions, free_port, wait_until


def test_a_process_that_exits_before_ready_leaves_its_last_log_lines(tmp_path):
    log = tmp_path / "child.log"
    lines = "; ".join(f"print('line {i}')" for i in range(60))
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", f"{lines}; raise SystemExit(3)"], stdout=out, stderr=out
        )
    with pytest.raises(RuntimeError) as err:
        wait_until(lambda: False, timeout_s=30, what="child", proc=proc, log=log)
    text = str(err.value)
    assert text.startswith("child: process exited with 3")
    assert "line 59" in text and "line 20" in text and "line 19\n" not in text  # the last 40


def test_a_wait_that_times_out_leaves_the_log_too(tmp_path):
    log = tmp_path / "child.log"
    log.write_text("binding ports\nstill importing\n")
    with pytest.raises(TimeoutError) as err:
        wait_until(lambda: False, timeout_s=0.1, what="child", log=log)
    assert "still importing" in str(err.value)
    with pytest.raises(TimeoutError) as err:
        wait_until(lambda: False, timeout_s=0.1, what="child", log=tmp_path / "none.log")
    assert "no log at" in str(err.value)


def test_a_picker_that_does_not_start_says_why(tmp_path):
    cfg = tmp_path / "picker.yaml"
    cfg.write_text("scheduling:\n  plugins:\n  - type: no-such-plugin\n")
    opts = StackOptions(upstreams=1, extproc_args=("--config", str(cfg)))
    with pytest.raises(RuntimeError) as err, Stack(opts):
        pass
    text = str(err.value)
    assert text.startswith("extproc: process exited with 2"), text
    assert "unknown plugin type 'no-such-plugin'" in text, text


def test_free_ports_are_drawn_below_the_ephemeral_range_pairs_included():
    # A port from bind(0) can be handed to an outgoing connection before the child binds
    # it; Redis Cluster's bus (+10000) must stay below that range too.
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    if low <= 22_000:
        pytest.skip("an ephemeral range this low leaves no room below it for a +10000 pair")
    for _ in range(50):
        assert free_port() < low
        port = free_port(paired=10_000)
        assert port + 10_000 < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port + 10_000))  # free when drawn


def test_a_drawn_port_is_not_drawn_again_by_this_or_another_process(tmp_path, monkeypatch):
    # Two pytest workers drawing the same port before either child bound it failed CI
    # ("address already in use"): the claims file keeps every caller of free_port apart.
    from extproc import stack

    base = stack.free_port_run(4)  # four ports free now, claimed in the real file
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the child's claims file too
    monkeypatch.setattr(stack, "_CLAIMS", tmp_path / Path(stack._CLAIMS).name)
    monkeypatch.setattr(stack, "_LISTEN_PORTS", (base, base + 3))
    drawn = {stack.free_port() for _ in range(4)}
    assert drawn == set(range(base, base + 4))  # nothing bound them: only claims tell
    other = subprocess.run(
        [
            sys.executable,
            "-c",
            "from extproc import stack; "
            f"stack._LISTEN_PORTS = ({base}, {base + 3}); print(stack.free_port())",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert int(other.stdout) not in drawn  # the range is claimed: the kernel's choice
