"""Malformed messages from inside the job: a registered worker and a registered server send every
message type with every field broken (tests/workers/fuzz_peer.py), strangers send bad registrations
and, in plain TCP, JSON the decoder cannot take. Each is refused, no node goes down, and the
job ends with exactly the values of a clean run."""

import json
import sys
import time

import numpy as np
import pytest
import zmq

from conftest import REPO
from conftest import expected
from tfkv.ps import protocol as P
from tfkv.ps import security

import fuzz_peer  # tests/workers, on pytest's pythonpath

FUZZ = str(REPO / "tests" / "workers" / "fuzz_peer.py")
WORKER = str(REPO / "tests" / "workers" / "dist_worker.py")


def _dealer(c, keys=True):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    security.client_socket(sock, c.keys if keys else None)
    sock.connect(f"tcp://127.0.0.1:{c.env['DMLC_PS_ROOT_PORT']}")
    return sock


def _register(meta_json: bytes) -> list[bytes]:
    head = P.HEADER.pack(P.MAGIC, P.VERSION, int(P.Type.REGISTER), P.FLAG_META, 0, 0, 1, 0, 0)
    return [head, meta_json]


BAD_REGISTRATIONS = [
    b'{"role":[],"host":"h","port":1,"pid":1,"hostname":"h"}',
    b'{"role":{},"host":"h","port":1,"pid":1,"hostname":"h"}',
    b'{"role":"worker","host":"h","port":1,"pid":1e400,"hostname":"h"}',
    b'{"role":"worker","host":"h","port":1,"pid":' + b"7" * 5000 + b',"hostname":"h"}',
    b'{"role":"scheduler","host":"h","port":1,"pid":1,"hostname":"h"}',
    b'{"role":"worker","host":["h"],"port":1,"pid":1,"hostname":"h"}',
]


@pytest.mark.slow
def test_a_registered_worker_and_server_cannot_break_the_job(cluster):
    steps, nkeys, size = 20, 2, 8
    c = cluster(num_servers=1, num_workers=2)
    c.start("scheduler", "scheduler", [sys.executable, "-m", "tfkv.ps.node"])
    # During registration: what crashed the scheduler is refused, with an error the sender can read.
    sock = _dealer(c)
    for meta in BAD_REGISTRATIONS:
        sock.send_multipart(_register(meta))
        assert sock.poll(10_000), f"no answer to {meta[:60]!r}:\n{c.output('scheduler')}"
        reply = P.decode(sock.recv_multipart())
        assert reply.type == P.Type.ERROR, reply
    sock.close()
    assert c.procs["scheduler"].poll() is None, c.output("scheduler")
    server_out = c.dir / "server.json"
    c.start("server 0", "server", [sys.executable, FUZZ, "server", str(server_out)], TFKV_RANK_HINT="0")
    out0 = c.dir / "worker0.json"
    c.start("worker 0", "worker", [sys.executable, WORKER, "int_sgd", str(out0), str(steps), str(nkeys), str(size)],
            TFKV_RANK_HINT="0")
    out1 = c.dir / "worker1.json"
    c.start("worker 1", "worker", [sys.executable, FUZZ, "worker", str(out1), str(steps), str(nkeys), str(size)],
            TFKV_RANK_HINT="1")
    codes = c.wait(180)
    assert all(v == 0 for v in codes.values()), f"{codes}\n{c.outputs()}"
    want = expected(steps, nkeys, 2)
    assert json.loads(out0.read_text())["final"] == want
    fuzzed = json.loads(out1.read_text())
    assert fuzzed["final"] == want
    assert fuzzed["cases"] > 150 and fuzzed["answered"] == fuzzed["cases"]
    assert fuzzed["not_refused"] == [], "\n".join(fuzzed["not_refused"])
    # The scheduler refused every malformed one of what the worker and the server sent it.
    malformed = 0
    for _, frames in fuzz_peer.scheduler_cases(1):
        try:
            P.decode(frames)
        except P.ProtocolError:
            malformed += 1
    assert malformed > 150
    assert json.loads(server_out.read_text())["to_scheduler"] == fuzzed["to_scheduler"]
    refused = c.output("scheduler").count("refused a malformed message")
    assert refused >= 2 * malformed, c.output("scheduler")[-3000:]


@pytest.mark.slow
def test_json_the_decoder_cannot_take_does_not_stop_a_plain_tcp_job(cluster):
    """A stranger's 5 KB message holding a 5,000-digit integer, before and after the cluster
    formed, to the scheduler and to a server."""
    steps, nkeys, size = 10, 1, 4
    c = cluster(num_servers=1, num_workers=1, TFKV_SECURE="0")
    big = b'{"role":"worker","host":"h","port":1,"pid":1,"hostname":"h","x":' + b"9" * 5000 + b"}"
    c.start("scheduler", "scheduler", [sys.executable, "-m", "tfkv.ps.node"])
    sock = _dealer(c, keys=False)
    sock.send_multipart(_register(big))
    assert sock.poll(10_000) and P.decode(sock.recv_multipart()).type == P.Type.ERROR
    c.start("server 0", "server", [sys.executable, "-m", "tfkv.ps.node"], TFKV_RANK_HINT="0")
    (out,) = c.start_workers("int_sgd", str(steps), str(nkeys), str(size), "0.1")
    deadline = time.time() + 60
    while "listening on" not in c.output("server 0"):
        assert time.time() < deadline, c.outputs()
        time.sleep(0.1)
    host, port = c.output("server 0").split("listening on ")[1].split()[0].split(":")
    to_server = zmq.Context.instance().socket(zmq.DEALER)
    to_server.setsockopt(zmq.LINGER, 0)
    to_server.connect(f"tcp://{host}:{port}")
    for _ in range(20):
        sock.send_multipart(_register(big))  # now from a stranger: dropped unread
        to_server.send_multipart(_register(big))
        time.sleep(0.05)
    assert to_server.poll(10_000) and P.decode(to_server.recv_multipart()).type == P.Type.ERROR
    sock.close()
    to_server.close()
    codes = c.wait(120)
    assert all(v == 0 for v in codes.values()), f"{codes}\n{c.outputs()}"
    assert json.loads(out.read_text())["final"] == expected(steps, nkeys, 1)
