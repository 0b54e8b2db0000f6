"""The runtime as a process tree: no orphans, Ctrl-C, torchrun, the magic in a kernel.

These tests need a parent process they can kill or interrupt, so each starts
one small script (the only place the suite starts processes outside the
shared pools).
"""

import os
import queue
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # zombies are dead
    except (FileNotFoundError, ProcessLookupError):  # gone, or gone between open and read
        return False


def _script(tmp_path, body: str) -> str:
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def _start(path, **kw):
    """Start ``path``; its output lines are read by a thread into ``proc.lines``."""
    proc = subprocess.Popen(
        [sys.executable, "-u", path],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **kw,
    )
    proc.lines = queue.Queue()

    def pump():
        for line in proc.stdout:
            proc.lines.put(line.rstrip("\n"))

    threading.Thread(target=pump, daemon=True).start()
    return proc


def _readline(proc, timeout=60.0) -> str:
    try:
        return proc.lines.get(timeout=timeout)
    except queue.Empty:
        proc.kill()
        raise AssertionError("the script printed nothing in time") from None


def _wait_dead(pids, seconds=10.0) -> list:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


@pytest.mark.parametrize("state", ["idle", "busy"])
def test_no_orphans_when_parent_is_killed(tmp_path, state):
    path = _script(
        tmp_path,
        f"""
        import time, shardlab
        ranks = shardlab.Ranks(2)
        print(" ".join(map(str, ranks.pids)), flush=True)
        if "{state}" == "busy":
            ranks.run(time.sleep, 120)
        else:
            time.sleep(120)
    """,
    )
    proc = _start(path)
    pids = [int(p) for p in _readline(proc).split()]
    assert len(pids) == 2 and all(_alive(p) for p in pids)
    time.sleep(0.5)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert _wait_dead(pids) == [], "rank processes outlived their parent"


def test_sigint_to_process_group_spares_idle_ranks_and_interrupts_busy_ones(tmp_path):
    path = _script(
        tmp_path,
        """
        import signal, sys, time, shardlab
        # a kernel handles SIGINT, even when whoever started it ignores it (a CI script run
        # in the background: bash starts those with SIGINT ignored, and children inherit it)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        ranks = shardlab.Ranks(2)
        pids = list(ranks.pids)
        try:  # printed inside the try: a SIGINT right after it is still caught
            print("ready", flush=True)
            sys.stdin.readline()                  # idle: Jupyter's interrupt arrives here
        except KeyboardInterrupt:
            print("kernel interrupted", flush=True)
        print("same pids" if ranks.pids == pids else "restarted", flush=True)
        print(ranks.run(lambda: shardlab.this_rank().rank), flush=True)
        try:
            print("busy", flush=True)
            ranks.run(time.sleep, 60)             # busy: the interrupt reaches the user code
            print("returned", flush=True)
        except KeyboardInterrupt:
            print("run interrupted", flush=True)
        print("same pids" if ranks.pids == pids else "restarted", flush=True)
        print(ranks.run(lambda: shardlab.this_rank().rank), flush=True)
        ranks.close()
    """,
    )
    proc = _start(path, start_new_session=True)  # its own process group, like a kernel
    assert _readline(proc) == "ready"
    time.sleep(0.3)
    os.killpg(proc.pid, signal.SIGINT)
    assert _readline(proc) == "kernel interrupted"
    assert _readline(proc) == "same pids"
    assert _readline(proc) == "[0, 1]"
    assert _readline(proc) == "busy"
    time.sleep(0.5)
    t0 = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    assert _readline(proc) == "run interrupted"
    assert time.monotonic() - t0 < 5
    assert _readline(proc) == "same pids"
    assert _readline(proc) == "[0, 1]"
    assert proc.wait(timeout=30) == 0


def test_same_script_under_torchrun(tmp_path):
    path = _script(
        tmp_path,
        """
        import atexit, os, torch, torch.distributed as dist, shardlab

        def threads():  # runs after shardlab's exit handler (registered later)
            tasks = os.listdir("/proc/self/task")
            names = [open(f"/proc/self/task/{t}/comm").read() for t in tasks]
            gloo = sum("gloo" in n for n in names)
            print(f"rank {os.environ['RANK']}: gloo threads left at exit: {gloo}", flush=True)

        atexit.register(threads)

        def body():
            x = torch.tensor([shardlab.this_rank().rank + 1.0])
            dist.all_reduce(x)
            return x.item()

        with shardlab.Ranks(2) as ranks:
            res = ranks.run(body)
            print(f"rank {shardlab.this_rank().rank}: {res} attached={ranks.attached}")
    """,
    )
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--standalone",
            path,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    # what the ranks printed comes first in torchrun's stderr, its own summary last
    assert out.returncode == 0, out.stdout + out.stderr[:3000] + "\n...\n" + out.stderr[-1500:]
    # the two ranks share torchrun's stdout: their lines may interleave
    found = re.findall(r"rank (\d): \[3\.0, 3\.0\] attached=True", out.stdout)
    assert sorted(found) == ["0", "1"], out.stdout
    # the groups' worker threads are joined before interpreter finalization (a thread
    # left there can abort the process when it drops a tensor Python owned)
    left = re.findall(r"rank (\d): gloo threads left at exit: (\d+)", out.stdout)
    assert sorted(left) == [("0", "0"), ("1", "0")], out.stdout


def test_magic_in_a_real_kernel():
    jupyter_client = pytest.importorskip("jupyter_client")
    km, kc = jupyter_client.manager.start_new_kernel(kernel_name="python3")
    try:

        def run(code):
            reply_outputs = []

            def hook(msg):
                if msg["msg_type"] == "stream":
                    reply_outputs.append(msg["content"]["text"])
                elif msg["msg_type"] == "error":
                    reply_outputs.append(
                        "ERROR " + msg["content"]["ename"] + ": " + msg["content"]["evalue"]
                    )

            kc.execute_interactive(code, timeout=120, output_hook=hook)
            return "".join(reply_outputs)

        assert run("%load_ext shardlab\nimport shardlab\nranks = shardlab.Ranks(3)") == ""
        out = run(
            "%%ranks --pull x\nx = torch.tensor([rank + 1.0])\ndist.all_reduce(x)\n"
            "print('sum', x.item())\nrank * 2"
        )
        assert out.splitlines() == [
            "[rank 0] sum 6.0",
            "[rank 0] 0",
            "[rank 1] sum 6.0",
            "[rank 1] 2",
            "[rank 2] sum 6.0",
            "[rank 2] 4",
        ]
        assert run("print([float(v) for v in x])") == "[6.0, 6.0, 6.0]\n"
        # state persists across cells; errors name the rank
        out = run("%%ranks\nif rank == 1:\n    raise KeyError('only here')\n")
        assert "ERROR RankError: rank 1 raised KeyError" in out
        assert run("%%ranks ranks\nprint(float(x))").splitlines() == [
            f"[rank {r}] 6.0" for r in range(3)
        ]
        assert "ERROR" in run("%%ranks nosuchpool\n1")
        pids = run("print(' '.join(map(str, ranks.pids)))").split()
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    assert _wait_dead([int(p) for p in pids]) == []


def test_nothing_leaked_after_a_pool_that_compiled(tmp_path):
    """A script whose ranks ran ``torch.compile`` (inductor draws a progress bar, whose
    lock is a named semaphore): after the pool closes and the script ends, Python's
    resource tracker reports nothing leaked (it reported 2 semaphores: the ranks left
    through ``os._exit``, past multiprocessing's finalizers)."""
    path = _script(
        tmp_path,
        """
        import shardlab

        def body():
            import torch
            f = torch.compile(lambda x: x * 2 + 1)
            return float(f(torch.ones(3)).sum())

        with shardlab.Ranks(2) as ranks:
            print(ranks.run(body))
        """,
    )
    # Warnings as errors where they can be: dev mode shows every ResourceWarning (an
    # unclosed file or socket) and makes it an error, in the script and in its ranks.
    # Not DeprecationWarning: torch 2.13's own inductor import warns of a decorator it
    # uses. Not UserWarning: the resource tracker swallows an error raised by its own
    # "leaked semaphore" warning, which would hide it; it is looked for below.
    warn = ["-X", "dev", "-W", "error::ResourceWarning", "-W", "ignore::DeprecationWarning"]
    out = subprocess.run([sys.executable, *warn, path], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[9.0, 9.0]"
    for sign in ("leaked", "resource_tracker", "ResourceWarning", "Exception ignored"):
        assert sign not in out.stderr, out.stderr
