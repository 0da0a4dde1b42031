"""Where a job's time goes: a Chrome-trace / Perfetto timeline of every role, and its merge.

`kvstore.timeline=DIR` (TFKV_TIMELINE) makes each role of a `dist_*` job write its own file,
DIR/worker-0.json, DIR/server-1.json, ..., in the Trace Event Format's JSON array form: "X"
(complete) events, `ts` and `dur` in microseconds, a process per role and a lane (`tid`) per
kind of work: a worker's steps (step, compute, each key's push and its packing, wait, assign)
on lane 0 and each key's request in flight (sent -> its reply landed) on a lane of its own; a
server's requests (each push, pull or pushpull, with the sum and the update it ran) and its
replies on lane 0. Nothing goes over the network: `python -m tfkv.timeline merge DIR -o
all.json` puts the files into one trace that chrome://tracing and ui.perfetto.dev open.

The clock is time.perf_counter: CLOCK_MONOTONIC on Linux, one clock for every process of a host
(so a worker's push and its server's receipt of it line up to the microsecond there) and one that
never steps when NTP sets the time. It means nothing across hosts, so each file records, once, the
pair (perf_counter, time.time) read together; `merge` moves each host's events onto the wall
clock by its first file's pair, one shift per host: a host's roles keep their exact order, and
hosts line up as well as their wall clocks agree (NTP: a millisecond or so).

Cost: recording is a tuple appended to a list; events are written in bulk, every FLUSH_EVENTS
events or FLUSH_SECONDS seconds (checked when one is recorded) and at exit, so memory stays
bounded and a role killed by its job's teardown (SIGHUP, no exit handlers) loses at most the last
seconds. A file stops at MAX_EVENTS events (a long job's file would grow without end), and says so.
A file cut short has no closing `]`, which both viewers accept and `merge` tolerates. Off, no
recorder exists: every hook is a None check. Imports nothing of tfkv but errors (servers use it).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Hashable, Iterable, Iterator, Sequence

from tfkv.errors import ConfigError, report

now = time.perf_counter  # seconds; the clock of every event (see the docstring)
MAIN = 0  # the lane of a role's own work
KEYS = 1000  # a worker's key lanes: KEYS, KEYS + 1, ... in the order the keys first travel
FLUSH_EVENTS = 8192
FLUSH_SECONDS = 2.0
MAX_EVENTS = 1_000_000  # about 150 MB of JSON per role
CLOCK = "tfkv_clock"  # the metadata event holding a file's (perf_counter, time.time) pair


class TimelineError(ConfigError):
    """A timeline directory that cannot be written."""


def directory(value: str, base: Path | None = None, what: str = "", remedy: str = " or set kvstore.timeline=null") -> Path:
    """The timeline directory `value` (relative to `base` if given), made and checked writable:
    TimelineError, one line naming `what` (kvstore.timeline=<value> unless given), otherwise."""
    path = Path(value).expanduser()
    if base is not None and not path.is_absolute():
        path = base / path
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".tfkv-timeline-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise TimelineError(f"{what or f'kvstore.timeline={value}'}: cannot write timeline files into {path} "
                            f"({e.strerror or e}); choose a writable directory{remedy}") from None
    return path.resolve()


def of(value: str | None, role: str, rank: int) -> Timeline | None:
    """The recorder of this role (DIR/<role>-<rank>.json) when `value` (ClusterEnv.timeline) names a
    directory; None when it is unset or empty, and every hook then costs a None check."""
    return Timeline(directory(value), role, rank) if value else None


class Timeline:
    """One role's events, buffered and appended to its file (see the module docstring)."""

    def __init__(self, where: Path, role: str, rank: int):
        self.path = Path(where) / f"{role}-{rank}.json"
        self.name = f"{role} {rank}"
        self._events: list[tuple] = []
        self._lanes: dict[Hashable, int] = {}  # a key -> its lane
        self._issued: dict[Hashable, float] = {}  # a key -> when its request left
        self._written = 0
        self._due = now() + FLUSH_SECONDS
        self._lock = threading.Lock()  # flushes from the main thread and a TensorFlow op's
        self._pid = os.getpid()
        self._file: Any = open(self.path, "w", encoding="utf-8")  # noqa: SIM115 - open for the role's life
        t, wall = now(), time.time()
        self._write([json.dumps(e) for e in (self._meta("process_name", {"name": self.name}),
                     self._meta("process_sort_index", {"sort_index": (role == "worker") * 1000 + rank}),
                     self._meta("thread_name", {"name": "steps" if role == "worker" else "requests"}, MAIN),
                     self._meta(CLOCK, {"host": socket.gethostname(), "perf_counter_us": t * 1e6,
                                        "unix_us": wall * 1e6, "clock": "perf_counter (CLOCK_MONOTONIC)"}))])
        atexit.register(self.close)

    # -- recording (the hooks) -----------------------------------------------------------------

    def span(self, name: str, start: float, end: float, lane: int = MAIN, args: dict | None = None) -> None:
        """An "X" event from `start` to `end` (now() readings)."""
        self._events.append((name, start, end, lane, args))
        if end > self._due or len(self._events) >= FLUSH_EVENTS:
            self.flush()

    def timed(self, fn: Callable, name: str, key_arg: int | None = None) -> Callable:
        """`fn`, its every call recorded as a `name` span (args: its argument `key_arg` as the key)."""
        def call(*a: Any, **kw: Any) -> Any:
            t = now()
            try:
                return fn(*a, **kw)
            finally:
                self.span(name, t, now(), MAIN, None if key_arg is None else {"key": _plain(a[key_arg])})
        return call

    def wrap(self, obj: Any, method: str, name: str, key_arg: int | None = None) -> None:
        """Time `obj.method` from now on (a server's reducer and updater: nothing in them changes)."""
        setattr(obj, method, self.timed(getattr(obj, method), name, key_arg))

    def issuing(self, fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """A worker's per-key request function (its argument's first item the key): its call
        recorded as "push" on lane 0 and the key's request in flight from then (`arrivals`)."""
        def issue(item: Any) -> Any:
            t = now()
            out = fn(item)
            key = item[0]
            self._issued[key] = t
            self.span("push", t, now(), MAIN, {"key": _plain(key)})
            return out
        return issue

    def arrivals(self, replies: Iterable[tuple[Hashable, Any]]) -> Iterator[tuple[Hashable, Any]]:
        """`replies` (a worker's (key, value) as each lands): each key's flight on its lane from
        its request to its reply, and the whole as "wait" on lane 0."""
        t = now()
        try:
            for key, value in replies:
                landed = now()
                self.span("pushpull" if key in self._issued else "pull", self._issued.pop(key, t), landed,
                          self._lane(key), {"key": _plain(key)})
                yield key, value
        finally:
            self.span("wait", t, now())

    def served(self, serve: Callable[[bytes, Any], None], identity: bytes, msg: Any) -> None:
        """A server's request `msg` (tfkv.ps.protocol.Message) served by `serve`: a span named by its
        type ("push", "pushpull", ...) with its key, sender and number (and a fused one's key count)."""
        t = now()
        try:
            serve(identity, msg)
        finally:
            args = {"key": msg.key, "sender": msg.sender, "seq": msg.seq}
            if isinstance(msg.meta, dict) and "keys" in msg.meta:
                args["keys"] = len(msg.meta["keys"])
            self.span(msg.type.name.lower(), t, now(), MAIN, args)

    def step(self, start: float, computed: float, assigned: float, end: float) -> None:
        """A worker's step from `start` to `end`: compute until `computed`, assign from `assigned`."""
        self.span("compute", start, computed)
        self.span("assign", assigned, end)
        self.span("step", start, end)

    # -- writing -------------------------------------------------------------------------------

    def flush(self) -> None:
        """Write what was recorded (at most MAX_EVENTS in the file, then a note that it is full)."""
        with self._lock:
            events, self._events = self._events, []
            self._due = now() + FLUSH_SECONDS
            room = MAX_EVENTS - self._written
            if self._file is None or not events:
                return
            pid, out, dumps = self._pid, [], json.dumps
            for name, t0, t1, lane, args in events[:max(room, 0)]:
                if name is None:  # a lane's name (_lane)
                    out.append(dumps(self._meta("thread_name", args, lane)))
                    continue
                # formatted by hand: json.dumps of a dict per event was most of the recorder's cost
                out.append(f'{{"name":"{name}","ph":"X","ts":{t0 * 1e6:.3f},"dur":{max(t1 - t0, 0) * 1e6:.3f},'
                           f'"pid":{pid},"tid":{lane}' + (f',"args":{_json(args)}}}' if args else "}"))
            if room < len(events):
                out.append(dumps({"name": f"timeline full ({MAX_EVENTS} events): later events not recorded", "ph": "i",
                                  "s": "p", "ts": round(events[-1][2] * 1e6, 3), "pid": pid, "tid": MAIN}))
            self._written += len(out)
            self._write(out)
        if room < len(events):
            self.close()

    def close(self) -> None:
        """Write what is left and end the file's array (a closed timeline records nothing more)."""
        if self._file is None:
            return
        self.flush()
        with self._lock:
            if self._file is not None:
                self._file.write("\n]\n")
                self._file.close()
                self._file = None
                self._events = []
                self.span = _ignore  # type: ignore[method-assign]
        atexit.unregister(self.close)

    def _lane(self, key: Hashable) -> int:
        lane = self._lanes.get(key)
        if lane is None:
            lane = self._lanes[key] = KEYS + len(self._lanes)
            self._events.append((None, 0.0, 0.0, lane, {"name": f"key {key}"}))  # its name, at the next flush
        return lane

    def _meta(self, name: str, args: dict, lane: int = MAIN) -> dict:
        return {"name": name, "ph": "M", "pid": self._pid, "tid": lane, "args": args}

    def _write(self, lines: list[str]) -> None:
        """JSON texts of events, appended to the file's array (opened by the first)."""
        self._file.write(("[\n" if self._file.tell() == 0 else ",\n") + ",\n".join(lines))
        self._file.flush()


def _ignore(*_: Any, **__: Any) -> None:
    return None


def _json(args: dict) -> str:
    """An event's args as JSON: ints written directly (keys, senders, numbers: nearly all of them)."""
    if all(type(v) is int for v in args.values()):
        return "{" + ",".join(f'"{k}":{v}' for k, v in args.items()) + "}"
    return json.dumps(args)


def _plain(key: Any) -> Any:
    return key if isinstance(key, (int, float, str)) else str(key)


# -- merging ------------------------------------------------------------------------------------

def read(path: Path) -> list[dict]:
    """A role's events, also from a file its role never closed (no `]`: it was killed)."""
    text = path.read_text(encoding="utf-8").rstrip().rstrip(",")
    if not text.endswith("]"):
        text += "]"
    try:
        events = json.loads(text)
    except json.JSONDecodeError as e:
        raise TimelineError(f"{path}: not a timeline file ({e}); merge only the files a job's roles wrote") from None
    return events


def merge(files: Sequence[Path]) -> dict:
    """One trace of every role's file: each role a process of its own (renumbered, so that pids
    of different hosts never collide), each host's events shifted onto the wall clock by the
    first of its files' clock pair, and the earliest event at 0."""
    merged: list[dict] = []
    shift: dict[str, float] = {}  # a host -> unix_us - perf_counter_us of its first file
    for pid, path in enumerate(sorted(files), start=1):
        events = read(path)
        clock = next((e["args"] for e in events if e.get("name") == CLOCK), None)
        if clock is None:
            raise TimelineError(f"{path}: no {CLOCK} event; it was not written by tfkv's timeline")
        offset = shift.setdefault(clock["host"], clock["unix_us"] - clock["perf_counter_us"])
        for e in events:
            if e["ph"] == "M" and e["name"] == "process_name":
                e["args"] = {"name": f"{e['args']['name']} ({clock['host']})"}
            e["pid"] = pid
            if "ts" in e:
                e["ts"] = e["ts"] + offset
            merged.append(e)
    timed = [e["ts"] for e in merged if "ts" in e]
    start = min(timed) if timed else 0.0
    for e in merged:
        if "ts" in e:
            e["ts"] = round(e["ts"] - start, 3)
    return {"traceEvents": merged, "displayTimeUnit": "ms",
            "otherData": {"roles": [Path(f).stem for f in sorted(files)], "start_unix_us": start}}


def main(argv: list[str] | None = None) -> None:
    """`python -m tfkv.timeline merge DIR [-o all.json]`."""
    parser = argparse.ArgumentParser(prog="python -m tfkv.timeline", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("merge", help="merge the roles' files of DIR into one trace")
    m.add_argument("dir", type=Path, help="the job's kvstore.timeline directory")
    m.add_argument("-o", "--output", type=Path, help="the merged trace (default: DIR/timeline.json)")
    args = parser.parse_args(argv)
    out = args.output or args.dir / "timeline.json"
    files = [f for f in sorted(args.dir.glob("*-*.json")) if f.resolve() != out.resolve()]
    try:
        if not files:
            raise TimelineError(f"{args.dir}: no role's timeline file (worker-0.json, server-0.json, ...) in it; "
                                "run the job with kvstore.timeline=DIR first")
        out.write_text(json.dumps(merge(files), separators=(",", ":")) + "\n", encoding="utf-8")
    except TimelineError as e:
        report("tfkv.timeline", e)
    print(f"{out}: {len(files)} roles ({', '.join(f.stem for f in files)})")


if __name__ == "__main__":
    main(sys.argv[1:])
