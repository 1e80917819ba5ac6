"""How a job's processes start and end: a rank dies with its launcher, says a failure once per node, and exits without teardown."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
import threading
import time

import utils

LAUNCHER_PID_ENV = "DPO_LAUNCHER_PID"
"""Set by train.py's ``launch`` and ``run_stages`` in each process they start: the launcher's pid (see :func:`die_with_launcher`)."""

PEER_LOST_EXIT = 3
"""A rank's exit code when another rank of its run stopped answering (:func:`lost_peer`)."""


def die_with_launcher(poll_s: float = 0.5) -> str | None:
    """In a rank that :func:`launch` or torchrun started, or a stage of ``run_stages``, be SIGKILLed when that launcher dies (``prctl(PR_SET_DEATHSIG)`` on
    Linux, else a thread polling every ``poll_s`` s); returns ``"train.py"``, ``"torchrun"`` or None (no launcher)."""
    launcher = os.environ.pop(LAUNCHER_PID_ENV, None)
    if launcher is not None:
        started_by, launcher = "train.py", int(launcher)
    elif "TORCHELASTIC_RUN_ID" in os.environ:
        started_by, launcher = "torchrun", os.getppid()
    else:
        return None
    kill = getattr(signal, "SIGKILL", None)  # not SIGTERM: nobody forwards signals now; checkpoints are atomic
    armed = False
    if sys.platform.startswith("linux") and kill is not None:
        import ctypes

        PR_SET_DEATHSIG = 1  # <linux/prctl.h>
        with contextlib.suppress(OSError, AttributeError):
            armed = ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DEATHSIG, int(kill), 0, 0, 0) == 0

    def gone() -> None:
        if kill is not None:
            os.kill(os.getpid(), kill)
        os._exit(137)

    if os.getppid() != launcher:  # it died before the death signal was set (or this is not its child)
        gone()
    if not armed:

        def watch() -> None:
            while os.getppid() == launcher:
                time.sleep(poll_s)
            gone()

        threading.Thread(target=watch, name="launcher-watch", daemon=True).start()
    return started_by


PEER_GONE = re.compile(r"Connection (?:reset|closed) by peer|Broken pipe")
"""What gloo's error says when another rank's end of the connection closed (the rank died)."""


def lost_peer(error: BaseException) -> str | None:
    """Why a collective failed when ``error`` or its causes say another rank is gone (gloo's :data:`PEER_GONE` phrase, a
    ``torch.distributed.DistError``'s first line), else None."""
    import torch.distributed as dist

    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        found = PEER_GONE.search(str(error)) if isinstance(error, RuntimeError) else None
        if found is not None:
            return found.group(0)
        if isinstance(error, dist.DistError):
            return utils.failure_reason(error)
        error = error.__cause__ or error.__context__
    return None


def how_to_continue(run_dir: str | None, command: str) -> str:
    """The end of a sentence on how to go on after a run stopped: ``<command> resume=<run_dir>`` when it has a checkpoint, else
    that there is none yet."""
    if run_dir is not None and os.path.lexists(os.path.join(run_dir, "LATEST")):
        return f"continue the run with {command} resume={run_dir}"
    if run_dir is not None:
        return f"the run saved no checkpoint in {run_dir} yet, so start it again"
    return "the run had made no run folder yet, so start it again"


def rank_failure(codes: dict[int, int], killed: set[int], stopped: set[int], run_dir: str | None) -> int:
    """The launcher's exit code from its ranks' ``codes`` (in the order they ended; ``killed``: ranks it killed): 0 when all
    finished, else the first self-failed rank's (128 + N for signal N, with an ``Error:`` line when it died without a word),
    else a stop's 128 + N, else ``PEER_LOST_EXIT``."""
    first = next(((r, c) for r, c in codes.items() if r not in killed and c not in (0, PEER_LOST_EXIT, *stopped)), None)
    if first is not None:
        rank, code = first
        if code < 0 or code not in (1, 2):
            name = next((s.name for s in signal.Signals if s == -code), f"signal {-code}")
            how = f"was killed by {name}" if code < 0 else f"exited with code {code}"
            print(
                f"Error: rank {rank} {how}, so the run stopped; {how_to_continue(run_dir, 'python train.py')}.",
                file=sys.stderr,
                flush=True,
            )
        return 128 - code if code < 0 else code
    failed = [c for c in codes.values() if c != 0]
    return next((c for c in failed if c in stopped), PEER_LOST_EXIT if failed else 0)


def exit_rank(run) -> None:
    """Run ``run()`` in an FSDP/TP rank, then leave with its exit code by ``os._exit`` after flushing, without the interpreter's
    teardown."""
    code = 0
    try:
        run()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # gloo threads freeing tensors in teardown could abort a finished run


def say_once_per_node(error: Exception, rank: int) -> None:
    """Print ``Error: <error>`` on each node's first process; the others wait 1 s so it is said before torchrun stops the group."""
    if int(os.environ.get("LOCAL_RANK", rank)) == 0:
        print(f"Error: {error}", file=sys.stderr, flush=True)
    else:
        time.sleep(1)


def says_once() -> bool:
    """Whether this process speaks for the run before it starts: torchrun's rank 0 or the user's process (not a launched rank)."""
    return int(os.environ.get("RANK", 0)) == 0 and ("RANK" not in os.environ or "TORCHELASTIC_RUN_ID" in os.environ)
