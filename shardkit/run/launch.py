"""``shardkit launch``: P processes × D CPU devices as one global mesh, and their faults.

Two halves, one per side of the process boundary:

The parent (``launch``) never touches a JAX backend. It picks a free port on 127.0.0.1, starts
P children ``python -m shardkit.cli <subcommand> ...``, each in its own session (so a terminal's
Ctrl-C reaches only the parent) with the ``SHARDKIT_*`` variables of ``mesh.PROCESS_ENV``, and
streams process 0's stdout and stderr as they come (its ``--json`` stays one parseable line: the
children send native libraries' stdout, gloo's per-connection lines, to /dev/null). The others'
output goes to ``LOG_DIR/process-K.log``. It polls the children: when one ends with a
non-zero status, it SIGKILLs the rest at once (DESIGN.md: SIGTERM is ignored after
``jax.distributed.initialize``), names the one that failed, prints the tail of its log and
returns its status. Ctrl-C, SIGTERM or SIGHUP to ``launch`` (handled even where a shell started
it with SIGINT ignored) and ``--timeout`` end every child the same way. Nothing outlives
``launch``.

The child side (``start_watchdog``, ``beat``): a process blocked in a collective waits forever
for a peer that hangs outside one (alive, so its heartbeats continue). ``beat()`` marks
progress (a train step, a verify case); a daemon thread ends the process (``os._exit``) with one
line when no beat came for ``SHARDKIT_WATCHDOG_S`` seconds, which makes ``launch`` end the rest.
The clock starts at the first beat (a compiled train step): start-up and the first compile take
as long as they take on a loaded host and are not a hang.
A peer that dies is caught sooner: by ``launch`` at its next poll (0.1 s), or, for processes
started by hand, by the coordination service after ``SHARDKIT_HEARTBEAT_S`` missed seconds.
"""

from __future__ import annotations

import codecs
import contextlib
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import IO

from shardkit.mesh import PROCESS_ENV

WATCHDOG_ENV = "SHARDKIT_WATCHDOG_S"
LAUNCH_ID_ENV = "SHARDKIT_LAUNCH_ID"  # marks every child of one launch (tests count them)
POLL_S = 0.1
WATCHDOG_STATUS = 3


class LaunchError(ValueError):
    """A launch that cannot start (bad counts, a port in use): one sentence."""


# ----------------------------------------------------------------------------- the parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def check_port(port: int) -> None:
    """LaunchError unless ``port`` on 127.0.0.1 can be bound now (the coordinator's)."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError as err:
            raise LaunchError(f"--port {port} is not free on 127.0.0.1 ({err.strerror}).") from err


def child_env(procs: int, index: int, port: int, heartbeat_s: int, watchdog_s: float,
              launch_id: str) -> dict[str, str]:  # fmt: skip
    """The environment of child ``index``: these variables are all a by-hand start needs."""
    return os.environ | {
        PROCESS_ENV["coordinator"]: f"127.0.0.1:{port}",
        PROCESS_ENV["count"]: str(procs),
        PROCESS_ENV["index"]: str(index),
        PROCESS_ENV["heartbeat_s"]: str(heartbeat_s),
        WATCHDOG_ENV: f"{watchdog_s:g}",
        LAUNCH_ID_ENV: launch_id,
    }


def _forward(stream: IO[bytes] | None, out: IO[str]) -> None:
    assert stream is not None
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")  # "×" may span two reads
    while chunk := os.read(stream.fileno(), 1 << 16):
        out.write(decoder.decode(chunk))
        out.flush()


def describe_status(status: int) -> str:
    if status < 0:
        return f"was killed by {signal.Signals(-status).name}"
    if status == WATCHDOG_STATUS:
        return "stopped by its watchdog (no progress)"
    return f"exited with status {status}"


def exit_code(status: int) -> int:
    """A child's status as a shell exit code (a signal N reads 128 + N)."""
    return 128 - status if status < 0 else status


class StoppedBySignal(Exception):  # noqa: N818 (a stop, not an error)
    """``launch`` itself got SIGINT (Ctrl-C), SIGTERM or SIGHUP."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_stopped(signum: int, frame: object) -> None:
    raise StoppedBySignal(signum)


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Launch:
    """P children of ``shardkit <argv>``; ``run`` starts them, returns the worst exit code and
    leaves none alive, whatever happens (a signal to ``launch`` included)."""

    def __init__(self, argv: Sequence[str], procs: int, port: int, log_dir: pathlib.Path,
                 heartbeat_s: int, watchdog_s: float) -> None:  # fmt: skip
        self.command = [sys.executable, "-m", "shardkit.cli", *argv]
        self.procs, self.port, self.log_dir = procs, port, log_dir
        self.heartbeat_s, self.watchdog_s = heartbeat_s, watchdog_s
        self.launch_id = f"{os.getpid()}-{time.time_ns()}"
        self.children: list[subprocess.Popen[bytes]] = []
        self.logs: list[IO[str]] = []
        self.threads: list[threading.Thread] = []

    def _start(self, index: int) -> None:
        env = child_env(self.procs, index, self.port, self.heartbeat_s, self.watchdog_s,
                        self.launch_id)  # fmt: skip
        if index == 0:
            pipe = subprocess.PIPE
            child = subprocess.Popen(self.command, env=env, stdout=pipe, stderr=pipe,
                                     start_new_session=True)  # fmt: skip
            for stream, out in ((child.stdout, sys.stdout), (child.stderr, sys.stderr)):
                thread = threading.Thread(target=_forward, args=(stream, out), daemon=True)
                thread.start()
                self.threads.append(thread)
        else:
            log = open(self.log_path(index), "w")  # noqa: SIM115 (closed in run)
            self.logs.append(log)
            child = subprocess.Popen(self.command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)  # fmt: skip
        self.children.append(child)

    def log_path(self, index: int) -> pathlib.Path:
        return self.log_dir / f"process-{index}.log"

    def kill_all(self) -> None:
        for child in self.children:
            if child.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.pid, signal.SIGKILL)  # the child and anything it started
        for child in self.children:
            child.wait()

    def run(self, timeout_s: float | None) -> int:
        start = time.monotonic()
        handlers = {sig: signal.signal(sig, _raise_stopped) for sig in STOP_SIGNALS}
        try:
            for index in range(self.procs):
                self._start(index)
            while True:
                statuses = [child.poll() for child in self.children]
                failed = [(i, s) for i, s in enumerate(statuses) if s not in (None, 0)]
                if failed:
                    index, status = failed[0]
                    self.kill_all()
                    self._report(index, status, time.monotonic() - start)
                    return exit_code(status)
                if all(s == 0 for s in statuses):
                    return 0
                if timeout_s is not None and time.monotonic() - start > timeout_s:
                    self.kill_all()
                    _say(f"--timeout {timeout_s:g} s passed; killed all {self.procs} processes.")
                    return 124
                time.sleep(POLL_S)
        except StoppedBySignal as stop:
            self.kill_all()
            why = "interrupted" if stop.signum == signal.SIGINT else f"got {stop}"
            _say(f"{why}; killed all {self.procs} processes.")
            return 128 + stop.signum
        finally:
            self.kill_all()
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
            for thread in self.threads:
                thread.join(timeout=5)
            for log in self.logs:
                log.close()

    def _report(self, index: int, status: int, elapsed: float) -> None:
        others = len(self.children) - 1
        _say(f"process {index} {describe_status(status)} after {elapsed:.1f} s; killed the "
             f"other {others} process{'es' if others != 1 else ''}.")  # fmt: skip
        if index == 0:
            return  # its output was streamed
        lines = self.log_path(index).read_text().splitlines()
        if lines:
            _say(f"last lines of {self.log_path(index)}:")
            for line in lines[-12:]:
                print(f"  {line}", file=sys.stderr)


def _say(message: str) -> None:
    print(f"shardkit launch: {message}", file=sys.stderr, flush=True)


def launch(argv: Sequence[str], procs: int, *, port: int | None = None,
           timeout_s: float | None = None, log_dir: str | None = None, heartbeat_s: int = 10,
           watchdog_s: float = 600.0) -> int:  # fmt: skip
    """Runs ``shardkit <argv>`` as ``procs`` processes; returns the worst exit code (0: all
    succeeded). ``argv`` was checked by the caller (``cli``) and its device count matches."""
    if port is None:
        port = free_port()
    else:
        check_port(port)
    logs = pathlib.Path(log_dir or tempfile.mkdtemp(prefix="shardkit-launch-"))
    logs.mkdir(parents=True, exist_ok=True)
    return Launch(argv, procs, port, logs, heartbeat_s, watchdog_s).run(timeout_s)


# ----------------------------------------------------------------------------- the children

_last_beat: float | None = None  # None: not armed yet (no beat since start)


def beat() -> None:
    """Marks progress for this process's watchdog (one clock read); the first beat arms it."""
    global _last_beat
    _last_beat = time.monotonic()


def start_watchdog(index: int, environ: dict[str, str] | None = None) -> None:
    """From ``SHARDKIT_WATCHDOG_S`` (unset: none), a daemon thread that ends this process with
    ``WATCHDOG_STATUS`` and one line when, after the first ``beat``, no other came for that many
    seconds."""
    text = (os.environ if environ is None else environ).get(WATCHDOG_ENV)
    if not text:
        return
    limit = float(text)

    def watch() -> None:
        while True:
            time.sleep(min(1.0, limit / 4))
            if _last_beat is None:
                continue
            idle = time.monotonic() - _last_beat
            if idle > limit:
                print(f"shardkit: process {index} made no progress for {idle:.0f} s (watchdog "
                      f"{limit:g} s): a peer may hang outside a collective; exiting.",
                      file=sys.stderr, flush=True)  # fmt: skip
                os._exit(WATCHDOG_STATUS)

    threading.Thread(target=watch, name="shardkit-watchdog", daemon=True).start()


def join_devices(n: int) -> None:
    """``n`` CPU devices in all: here, or over the processes the ``SHARDKIT_*`` variables name
    (``shardkit launch`` sets them; DESIGN.md's ``mesh.PROCESS_ENV``), joined into one mesh.
    Only process 0 prints to stdout."""
    from shardkit.mesh import Processes, set_cpu_devices

    procs = Processes.from_env()
    if procs is None:
        set_cpu_devices(n)
        return
    _native_stdout_to_devnull(keep_python_stdout=procs.index == 0)
    procs.join(n)
    start_watchdog(procs.index)


def _native_stdout_to_devnull(keep_python_stdout: bool) -> None:
    """File descriptor 1 to /dev/null: native libraries' prints (gloo writes a line per peer
    connection there, from several threads at once) never mix into ``--json``. Python's
    ``sys.stdout`` keeps the real stdout where ``keep_python_stdout``, else /dev/null too."""
    sys.stdout.flush()
    real = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)
    if keep_python_stdout:
        sys.stdout = os.fdopen(real, "w", buffering=1)
    else:
        os.close(real)
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (for the process's lifetime)
