"""Start ``python SCRIPT ARGS`` / ``python -m megatron_lol ARGS`` processes without paying the imports.

The fault, checkpoint and cluster tests start the CLI as an operator (or ``srun``) would, one real
process per run or rank, and then kill, stop or signal it. A new interpreter spends ~4 s of CPU on
``import megatron.core`` before it reads its first argument, so those tests were mostly start-up.
:func:`start` forks each process from the forkserver of :mod:`distributed` (one clean interpreter
per test process that has imported torch and megatron-core once, never touched a process group,
and is not the test process). The child then behaves as the new interpreter would:

* its own session (``start_new_session=True``: ``os.killpg(proc.pid, ...)`` reaches it and its
  children), working directory and environment (the one given, at the call);
* stdout and stderr written to ``log`` (line-buffered, as ``PYTHONUNBUFFERED=1`` makes them), stdin
  ``/dev/null``;
* the script runs as ``__main__`` (``runpy``), ``sys.argv`` as the command line gives it, warnings
  filtered as ``PYTHONWARNINGS`` says, torch's intra-op threads as ``OMP_NUM_THREADS`` says;
* its exit status is ``SystemExit``'s code, or ``-N`` after signal N, and ``atexit`` handlers run
  on a normal exit, as the interpreter's would.

What a forked start cannot show is the interpreter's own start-up (imports, argument parsing before
them); ``torchrun`` launches (the agent starts its workers itself) and the Slurm tests keep that
covered.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from distributed import rank_context


class ForkedProcess:
    """The part of :class:`subprocess.Popen` the tests use, for a process forked by :func:`start`."""

    def __init__(self, process, args: list):
        self._process = process
        self.args = args
        self.pid = process.pid

    @property
    def returncode(self):
        return self._process.exitcode

    def poll(self):
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


def _child(argv: list, env: dict, cwd: str, log: str) -> None:
    """The forked process: become the interpreter ``python *argv`` would have started, then run it."""
    import atexit
    import runpy
    import warnings

    os.setsid()
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    if env.get("PYTHONWARNINGS") == "ignore":
        warnings.simplefilter("ignore")
    if env.get("OMP_NUM_THREADS", "").isdigit():
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    code = 0
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as stop:
        code = stop.code
    finally:
        atexit._run_exitfuncs()
    sys.exit(code)


def start(argv: list, *, env: dict, log: Path, cwd: Path) -> ForkedProcess:
    """``python *argv`` (``argv[0]`` a script path, or ``-m``, module, args...) as a forked process
    writing ``log``; returns its :class:`ForkedProcess`."""
    argv = [str(a) for a in argv]
    open(log, "ab").close()  # there from the call on, as the file a shell redirects into would be
    process = rank_context().Process(target=_child, args=(argv, dict(env), str(cwd), str(log)), daemon=False)
    process.start()
    return ForkedProcess(process, [sys.executable, *argv])


class RankGroup:
    """``world`` ranks of one run started as ``srun`` starts them (one process each, torchrun's
    environment, no agent), seen as one process: ``wait`` gives the first non-zero status by rank
    (0 when every rank succeeded), as a launcher would report the job."""

    def __init__(self, ranks: list):
        self.ranks = ranks
        self.pid = ranks[0].pid
        self.args = ranks[0].args

    @property
    def returncode(self):
        return self.poll()

    def poll(self):
        """The first failed rank's status as soon as one fails (the job has failed then), 0 once
        every rank succeeded, None while it runs."""
        codes = [r.poll() for r in self.ranks]
        failed = [c for c in codes if c not in (None, 0)]
        if failed:
            return failed[0]
        return None if None in codes else 0

    def wait(self, timeout: float | None = None) -> int:
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        for r in self.ranks:
            r.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return next((r.poll() for r in self.ranks if r.poll() != 0), 0)

    def send_signal(self, sig: int) -> None:
        for r in self.ranks:
            r.send_signal(sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def start_ranks(argv: list, world: int, *, env: dict, log: Path, cwd: Path) -> RankGroup:
    """``world`` ranks of ``python *argv`` writing one ``log`` (as torchrun merges its workers'
    output), rank 0 hosting the rendezvous store on a free port."""
    from distributed import free_port

    port = free_port()
    ranks = []
    for r in range(world):
        rank_env = dict(
            env,
            RANK=str(r),
            LOCAL_RANK=str(r),
            WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        ranks.append(start(argv, env=rank_env, log=log, cwd=cwd))
    return RankGroup(ranks)


def run_ranks(argv: list, world: int, *, env: dict, cwd: Path, log: Path, timeout: float) -> tuple:
    """:func:`start_ranks` to the end: ``(status, output)``; a run past ``timeout`` is killed and
    reported as status ``None`` (a hang)."""
    group = start_ranks(argv, world, env=env, log=log, cwd=cwd)
    try:
        status = group.wait(timeout)
    except subprocess.TimeoutExpired:
        status = None
    finally:
        for rank in group.ranks:
            if rank.poll() is None:
                os.killpg(rank.pid, signal.SIGKILL)
                rank.wait()
    return status, Path(log).read_text(errors="replace")


def forked_run(
    cmd: list,
    *,
    env: dict,
    cwd,
    stdout=None,
    stderr=None,
    capture_output: bool = False,
    text: bool = False,
    check: bool = False,
    timeout: float | None = None,
) -> subprocess.CompletedProcess:
    """:func:`subprocess.run` for a ``[sys.executable, ...]`` command, forked by :func:`start`: the same
    exit status and output (``capture_output``, or ``stdout`` an open file that the output is appended
    to; stderr goes with stdout, as ``stderr=subprocess.STDOUT`` would have it: the one ``stderr`` taken)."""
    import tempfile

    if stderr not in (None, subprocess.STDOUT):
        raise ValueError("forked_run writes stderr with stdout (one log): stderr=subprocess.STDOUT or nothing")

    if Path(cmd[0]).name != Path(sys.executable).name and cmd[0] != sys.executable:
        raise ValueError(f"forked_run starts python commands only, not {cmd[0]}")
    with tempfile.TemporaryDirectory(prefix="forked-run-") as scratch:
        log = Path(scratch) / "output"
        proc = start(cmd[1:], env=env, log=log, cwd=Path(cwd))
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        output = log.read_bytes()
    if stdout is not None and hasattr(stdout, "write"):
        stdout.flush()
        with open(stdout.fileno(), "ab", closefd=False) as sink:
            sink.write(output)
        output = b""
    captured = (output.decode(errors="replace") if text else output) if capture_output else None
    if check and code:
        raise subprocess.CalledProcessError(code, cmd, captured)
    # stderr is in stdout (one log): a caller that reads proc.stderr gets the same text
    return subprocess.CompletedProcess(cmd, code, captured, captured)


def torchrun_command(nproc: int, *argv) -> list:
    """A real ``torchrun`` of ``nproc`` workers on this host running ``python *argv`` (a script path, or
    ``-m`` and a module): the agent and fresh interpreters, for what only its launch and teardown show."""
    from distributed import free_port

    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        *map(str, argv),
    ]
