"""The one supervisor of a job's roles, for every launcher backend, the benchmarks and the tests:
wait until the job ends by itself or a role fails, name the first real failure, tear the rest
down as a group, and say how the job ended.

A backend supplies how to start its roles, how to tell that the job is over (`over`), where the
roles' ends are seen (an `Ends`, fed from exit statuses, ssh channels or the role helper's exit
lines) and how to stop what still runs (`teardown`). The policy is here, once:

- a role that fails first gets the others GRACE seconds to notice on their own and exit; then the
  rest is torn down. A role that exits with tfkv.errors.EXIT_PEER_FAILED or EXIT_PEER_SILENT only
  reacts to another one's failure and is never the one blamed; while every failure is such a
  reaction, the cause is a role still running (hung, or slow to exit), which gets HANG_GRACE
  before it is blamed, unless a role saw a peer go silent (EXIT_PEER_SILENT) and only one role
  still runs: that one is the silent one, hung (it never exits), blamed at once;
- the first SIGINT/SIGTERM (tfkv.launcher.signals) stops the wait, the failure line says so and
  the teardown runs shielded from further signals. A backend that can (`interrupt`) first passes
  a Ctrl-C on to worker 0 and waits up to FINISH seconds for it to end, the other roles still
  running: worker 0 finishes the checkpoint it is writing (tfkv.checkpoint.interrupt;
  it reads the servers' optimizer state) instead of being torn down in the middle of it. A second
  Ctrl-C (or SIGTERM) stops that wait;
- when every failure is a reaction, no role is left running and a role exited 0 (a worker whose
  script ended and closed its store while the others still pushed: servers and the scheduler
  end 0 only once every worker finished), that worker is the cause: it left the job early, and
  the dist_sync round or barrier it never joins stopped the others (tfkv.ps.departures). Its
  line says so (LEFT_EARLY); an early end in dist_async, which has no rounds, is no failure;
- the cause is told from what had ended when the teardown began: a role the teardown kills is
  not blamed for being killed.
"""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from typing import Callable, Mapping, Sequence

from tfkv import preempt
from tfkv.errors import EXIT_PEER_FAILED, EXIT_PEER_SILENT
from tfkv.launcher import signals
from tfkv.launcher.process import signal_group, status_text

GRACE = 2.0  # seconds the other roles get to notice a failure on their own before teardown
# When every failure so far is a peer's reaction (EXIT_PEER_FAILED), the cause is a role still
# running: hung, or only slow to exit after reporting its own failure (TensorFlow's teardown on a
# loaded machine takes seconds). It gets this long to end before it is blamed as hung.
HANG_GRACE = 6.0
INTERVAL = 0.05  # seconds between two looks at the roles
# How the teardown asks a role to stop: SIGHUP, whose default action ends a process at once and
# silently (SIGINT would be a KeyboardInterrupt and its traceback in a role still importing).
# Not SIGTERM, which a role takes as a batch system's preemption (tfkv.preempt: a server serves
# on, a worker finishes its step).
STOP = signal.SIGHUP
# How long a Ctrl-C'd job's workers get to end by themselves before the teardown: a worker's own
# grace for the checkpoint it is writing (tfkv.checkpoint.interrupt), and GRACE to exit after it.
FINISH = preempt.GRACE + GRACE
REACTIONS = (EXIT_PEER_FAILED, EXIT_PEER_SILENT)  # statuses of a role that stopped because of a peer
# The cause's words when a worker ended (status 0) while the others still needed it. "exited with
# status 0" in it is what tfkv.launcher.process.repeats reads: the same script ends as early again.
LEFT_EARLY = (f"left the job early: it {status_text(0)} while the other workers still needed it in a dist_sync "
              "round or barrier; every worker must push each key and reach each barrier as often as the others "
              "(give each the same number of steps), or use dist_async")


def done_waiting(failed: list[tuple[str, int]], since: float | None, now: float, running: int = 0) -> bool:
    """Whether a launcher has waited long enough after the first failure (seen at `since`) to
    tear the job down, `running` roles still running: GRACE once a failure names its own cause;
    at once when a role saw a peer go silent and one role runs on (the silent one: the others
    stopped as they were told to, so it is hung, not exiting); else HANG_GRACE, so that a role
    still exiting is not blamed for a hang."""
    if since is None:
        return False
    if any(code not in REACTIONS for _, code in failed):
        return now - since > GRACE
    if running <= 1 and any(code == EXIT_PEER_SILENT for _, code in failed):
        return True
    return now - since > HANG_GRACE


def first_cause(failed: list[tuple[str, int]], running: Sequence[str] = (),
                finished: Sequence[str] = ()) -> str | None:
    """Processes that stopped because a peer failed say so with EXIT_PEER_FAILED: the cause is
    the first failure that did not. When every failure did, the cause is whatever is still
    `running` (roles that had not ended when the launcher looked): a role that hangs (stopped,
    deadlocked) lives on while the others stop because it stopped answering. When none is
    running either, it is the first worker that `finished` (exited 0): it left early. Unless the
    scheduler finished too, which it does only once every worker has (then a role that missed
    its SHUTDOWN is the one to name). Names as tfkv.launcher.plan.make_plan gives them."""
    causes = [f for f in failed if f[1] not in REACTIONS]
    if causes:
        return f"{causes[0][0]} {status_text(causes[0][1])}"
    if failed and running:
        return (f"{' and '.join(running)} stopped answering (still running when the others had stopped because "
                "a peer failed)")
    leavers = [n for n in finished if n.startswith("worker ")]
    if failed and leavers and not any(n.startswith("scheduler") for n in finished):
        return f"{leavers[0]} {LEFT_EARLY}"
    return f"{failed[0][0]} {status_text(failed[0][1])}" if failed else None


class Ends:
    """How the roles of one job ended, in the order the ends were seen (thread-safe: output
    threads report them). `names` are the job's roles; those that never reported are running."""

    def __init__(self, names: Sequence[str] = ()):
        self.names = list(names)
        self.codes: dict[str, int] = {}
        self.failed: list[tuple[str, int]] = []
        self.first_failure_at: float | None = None
        self.frozen: tuple[list[tuple[str, int]], list[str], list[str]] | None = None
        self.lock = threading.Lock()

    def ended(self, name: str, code: int) -> None:
        """`name` ended with `code` (negative: killed by that signal); only its first end counts."""
        with self.lock:
            if name in self.codes:
                return
            self.codes[name] = code
            if code != 0:
                self.failed.append((name, code))
                self.first_failure_at = self.first_failure_at or time.monotonic()

    def running(self) -> list[str]:
        return [n for n in self.names if n not in self.codes]

    def finished(self) -> list[str]:
        """The roles that exited 0, in the order they ended."""
        return [n for n, code in self.codes.items() if code == 0]

    def grace_over(self, extra: float = 0.0) -> bool:
        """done_waiting after the first failure, plus `extra` seconds (a client's own teardown)."""
        with self.lock:
            return done_waiting(self.failed, self.first_failure_at, time.monotonic() - extra, len(self.running()))

    def freeze(self) -> None:
        """The teardown begins: the cause is told from what ended before it (a hung role then ends
        too, killed by the teardown, and must not be blamed for that)."""
        with self.lock:
            self.frozen = (list(self.failed), self.running(), self.finished())

    def cause(self) -> str | None:
        with self.lock:
            if self.frozen is not None:
                return first_cause(*self.frozen)
            return first_cause(self.failed, self.running(), self.finished())


def supervise(ends: Ends, over: Callable[[], bool], teardown: Callable[[], None], *,
              start: Callable[[], str | None] | None = None, then: Callable[[], str | None] | None = None,
              interrupt: Callable[[], Sequence[str]] | None = None, extra: float = 0.0,
              interval: float = INTERVAL) -> str | None:
    """Run one job to its end; its failure line, or None when it succeeded.

    `start()` starts the roles (a line when one could not start: no wait then); `over()` looks
    at them, feeding `ends`, and says whether the job ended by itself; the wait also ends once
    the grace after the first failure (plus `extra`) is over. `then()` runs when the job ended by
    itself (waiting for what ends last, such as a scheduler; a line when that fails). `teardown()`
    always runs, shielded from SIGINT/SIGTERM, also when an exception escapes. Ctrl-C/SIGTERM
    gives their line; otherwise the first failure `ends` names. `interrupt()` passes a Ctrl-C on
    to worker 0 (the names of the roles it reached): then the teardown waits until they ended
    (`finish_workers`)."""
    failure = None
    try:
        failure = start() if start is not None else None
        if failure is None:
            while not over() and not ends.grace_over(extra):
                time.sleep(interval)
            if over():
                failure = then() if then is not None else None
            else:
                ends.freeze()
    except KeyboardInterrupt as e:
        failure = signals.failure(e)
        if interrupt is not None and failure == signals.WHAT[signal.SIGINT]:
            finish_workers(ends, over, interrupt, interval)
    finally:
        with signals.shielded():
            teardown()
    return failure or ends.cause()


def finish_workers(ends: Ends, over: Callable[[], bool], interrupt: Callable[[], Sequence[str]],
                   interval: float = INTERVAL, limit: float = FINISH) -> None:
    """After the launcher's Ctrl-C: `interrupt()` (Ctrl-C to worker 0), then wait until the roles
    it reached ended (`over` feeds `ends`), at most `limit` seconds; a second Ctrl-C or a SIGTERM
    ends the wait at once. Not for the other roles to end by themselves too: once worker 0 (whose
    checkpoint is then written) ended, the teardown ends them faster than their own exits."""
    deadline = time.monotonic() + limit
    try:
        with signals.interruptible():
            reached = interrupt()
            while (not over() and any(n in reached for n in ends.running())
                   and time.monotonic() < deadline):
                time.sleep(interval)
    except KeyboardInterrupt:
        pass


def returncode(failure: str | None) -> int:
    """A job's exit status from its failure line (job.launch makes it 128 + N after signal N)."""
    return 0 if failure is None else 1


def poll(children: Mapping[str, subprocess.Popen], ends: Ends) -> Callable[[], bool]:
    """`over` for processes this one started: every child polled (not any(), which stops at the
    first one running: polling is what reaps a child and sets its returncode), each end fed to
    `ends`; true once all ended."""
    def over() -> bool:
        running = [c.poll() is None for c in children.values()]
        for name, c in children.items():
            if c.returncode is not None:
                ends.ended(name, c.returncode)
        return not any(running)
    return over


def stop_groups(children: Sequence[subprocess.Popen], grace: float = 3.0) -> None:
    """Stop every process group still running (STOP), give them `grace` seconds, then kill every
    group (also whatever a finished role left behind in its group); reap them all."""
    alive = [c for c in children if c.poll() is None]
    for c in alive:
        signal_group(c.pid, STOP)
        signal_group(c.pid, signal.SIGCONT)  # a stopped (hung) role acts on STOP only once resumed
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(c.poll() is None for c in alive):
        time.sleep(INTERVAL)
    for c in children:
        signal_group(c.pid, signal.SIGKILL)
        try:
            c.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
