"""Trust: CURVE keys on every socket, strangers refused, keys never on a command line, and a lossy
link under PS_RESEND that still ends with exactly the clean run's weights."""

import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from conftest import REPO, TAG, expected, tagged_pids
from proxy import LossyProxy
from tfkv.launcher.ports import free_port
from tfkv.ps import protocol as P
from tfkv import keys as job_keys
from tfkv.ps import security

WORKER = str(REPO / "tests" / "workers" / "dist_worker.py")


def _stranger_push(address: str, keys: job_keys.Keys | None, server_key: bytes | None) -> zmq.Socket:
    """A DEALER that sends valid-looking pushes, as worker ids 1..3, to `address`."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        sock.curve_secretkey, sock.curve_publickey, sock.curve_serverkey = keys.secret, keys.public, server_key
    # A refused handshake can leave the DEALER with no peer ("mute"), where a blocking send waits
    # forever: send with a timeout and stop once the socket takes nothing more.
    sock.setsockopt(zmq.SNDTIMEO, 200)
    sock.connect(address)
    try:
        for sender in (1, 2, 3):
            for seq in range(1, 20):
                for msg in (P.Message(P.Type.PUSH, sender=sender, seq=10_000 + seq, key=0,
                                      data=np.full(64, 1e6, np.float32)),
                            P.Message(P.Type.INIT, sender=sender, seq=20_000 + seq, key=0,
                                      data=np.zeros(64, np.float32)),
                            P.Message(P.Type.FAILED, sender=sender, meta={"reason": "stranger"}),
                            P.Message(P.Type.DONE, sender=sender)):
                    sock.send_multipart(P.encode(msg))
    except zmq.Again:
        pass  # refused before its queue even opened
    return sock


@pytest.mark.slow
def test_strangers_are_refused_and_the_job_goes_on(cluster):
    c = cluster(num_servers=1, num_workers=2)
    assert c.keys is not None  # the test helper runs secure by default, as the launcher does
    c.start_servers()
    outs = c.start_workers("int_sgd", "40", "1", "64", "0.05")
    host, port = c.listening("server 0")
    time.sleep(1)  # the job is under way
    socks = []
    for address in (f"tcp://{host}:{port}", f"tcp://127.0.0.1:{c.env['DMLC_PS_ROOT_PORT']}"):
        socks.append(_stranger_push(address, None, None))  # no keys at all
        socks.append(_stranger_push(address, job_keys.new_keys(), c.keys.public))  # a wrong keypair
    for s in socks:
        assert not s.poll(500)  # nobody answers a stranger
        s.close()
    codes = c.wait(120)
    assert all(v == 0 for v in codes.values()), c.outputs()
    for out in outs:
        assert json.loads(out.read_text())["final"] == expected(40, 1, 2)


@pytest.mark.slow
def test_insecure_cluster_runs_plain_with_a_warning(cluster):
    c = cluster(num_servers=1, num_workers=1, TFKV_SECURE="0")
    assert c.keys is None and job_keys.PUBLIC not in c.env
    c.start_servers()
    (out,) = c.start_workers("int_sgd", "3", "1", "8")
    codes = c.wait(120)
    assert all(v == 0 for v in codes.values()), c.outputs()
    assert json.loads(out.read_text())["final"] == expected(3, 1, 1)
    assert "WITHOUT authentication or encryption" in c.output("server 0")
    assert "WITHOUT authentication or encryption" in c.output("scheduler")


def test_plan_with_secure_false_warns_and_turns_curve_off(tmp_path, caplog, monkeypatch):
    from tfkv.launcher import job

    # An earlier test in this process may have configured logging (a run's Hydra job_logging
    # disables or re-levels loggers): the warning is asked of a logger as a fresh process has it.
    monkeypatch.setattr(job_keys, "_warned", set())
    tfkv_log = logging.getLogger("tfkv")
    for name, value in (("disabled", False), ("propagate", True), ("level", logging.NOTSET)):
        monkeypatch.setattr(tfkv_log, name, value)
    with caplog.at_level(logging.WARNING):
        j = job.plan_job(job.Options("local", 1, 1, secure=False), ["true"], tmp_path, tmp_path / "run")
    assert "WITHOUT authentication" in caplog.text
    assert all(p.env.get("TFKV_SECURE") == "0" and job_keys.SECRET not in p.env for p in j.plan)
    j = job.plan_job(job.Options("local", 1, 1), ["true"], tmp_path, tmp_path / "run")
    secrets = {p.env[job_keys.SECRET] for p in j.plan}
    assert len(secrets) == 1  # one fresh keypair for the whole job
    assert all(job_keys.SECRET not in " ".join(p.argv) and secrets.pop() not in " ".join(p.argv) for p in j.plan[:1])


def test_every_socket_bounds_what_an_unauthenticated_peer_costs():
    # (A CURVE server socket starts this process's ZAP handler for good: the slow test below
    # covers that case in the server's own process.)
    ctx = zmq.Context.instance()
    for kind, make, keys in ((zmq.ROUTER, security.server_socket, None), (zmq.DEALER, security.client_socket, None),
                             (zmq.DEALER, security.client_socket, job_keys.new_keys())):
        sock = ctx.socket(kind)
        make(sock, keys)
        assert sock.getsockopt(zmq.MAXMSGSIZE) == P.MAX_FRAME <= (1 << 20) + 4096
        assert sock.getsockopt(zmq.HANDSHAKE_IVL) == security.HANDSHAKE_SECONDS * 1000 <= 10_000
        sock.close(linger=0)


def test_the_largest_control_message_passes_the_frame_cap_under_curve():
    """CURVE adds bytes to every frame and libzmq counts them against the cap: the largest frame
    the CURVE control plane carries (metadata of MAX_META) must leave room (1 MiB payload frames
    were dropped, and every secure job with a key over 1 MiB failed with 'the reply was lost';
    payloads now travel on the sealed data plane). In a child: a CURVE server socket starts a ZAP thread."""
    code = ("import zmq; from tfkv import keys as job_keys; from tfkv.ps import protocol as P, security\n"
            "keys = job_keys.new_keys(); ctx = zmq.Context()\n"
            "r = ctx.socket(zmq.ROUTER); security.server_socket(r, keys); port = r.bind_to_random_port('tcp://127.0.0.1')\n"
            "d = ctx.socket(zmq.DEALER); security.client_socket(d, keys); d.connect(f'tcp://127.0.0.1:{port}')\n"
            "meta = {'reason': 'x' * (P.MAX_META - len('{\"reason\":\"\"}'))}\n"
            "d.send_multipart(P.encode(P.Message(P.Type.FAILED, meta=meta)))\n"
            "assert r.poll(10000), 'the message never arrived: its sender was disconnected'\n"
            "assert len(r.recv_multipart()[2]) == P.MAX_META\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_key_files_are_private_and_checked(tmp_path):
    keys = job_keys.new_keys()
    path = job_keys.write_keyfile(tmp_path / "launch" / "curve.key", keys)
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert job_keys.keys_from_env({job_keys.KEYFILE: str(path)}) == keys
    os.chmod(path, 0o644)
    with pytest.raises(job_keys.SecurityError, match="readable by others"):
        job_keys.read_keyfile(str(path))
    other = job_keys.new_keys()
    with pytest.raises(job_keys.SecurityError, match="does not belong"):
        job_keys.keys_from_env({job_keys.PUBLIC: other.public.decode(), job_keys.SECRET: keys.secret.decode()})
    with pytest.raises(job_keys.SecurityError, match="no job keys"):
        job_keys.keys_from_env({job_keys.SECURE: "1"})
    assert "secret" not in repr(keys).lower().replace("keys(public", "")
    # Launchers that may put the environment on a command line (mpi, slurm, ...) get a key file.
    from tfkv.launcher import job

    j = job.plan_job(job.Options("slurm", 1, 1), ["true"], tmp_path, tmp_path / "run")
    keyfile = j.plan[0].env[job_keys.KEYFILE]
    assert os.stat(keyfile).st_mode & 0o777 == 0o600 and job_keys.SECRET not in j.plan[0].env


@pytest.mark.slow
def test_the_launcher_puts_no_key_on_any_command_line(tmp_path):
    """A local job's roles hold the keys in their environment, never in argv; the record has none."""
    tag = f"cmdline-{os.getpid()}"
    run_dir = tmp_path / "run"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "tfkv.launcher.cli", "--launcher", "local", "-n", "2", "-s", "1",
         "--run-dir", str(run_dir), "--", sys.executable, WORKER, "int_sgd", str(tmp_path / "w{rank}.json"),
         "60", "1", "16", "0.05"],
        cwd=tmp_path, env={**os.environ, TAG: tag}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        seen: dict[int, tuple[bytes, bytes]] = {}
        deadline = time.time() + 60
        while time.time() < deadline and len(seen) < 4:  # scheduler, server, 2 workers
            for pid in tagged_pids(tag):
                try:
                    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                    argv = Path(f"/proc/{pid}/cmdline").read_bytes()
                except OSError:
                    continue
                secret = [e.split(b"=", 1)[1] for e in env if e.startswith(job_keys.SECRET.encode() + b"=")]
                if secret and pid != launcher.pid:
                    seen[pid] = (secret[0], argv)
            time.sleep(0.2)
        assert len(seen) >= 4, f"found only {len(seen)} roles holding keys"
        secrets = {s for s, _ in seen.values()}
        assert len(secrets) == 1
        secret = secrets.pop()
        for pid in tagged_pids(tag):
            try:
                assert secret not in Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
        out, _ = launcher.communicate(timeout=120)
        assert launcher.returncode == 0, out.decode()[-3000:]
    finally:
        launcher.kill()
    record = (run_dir / "launch" / "plan.json").read_text()
    assert secret.decode() not in record and "<not recorded>" in record
    assert not (run_dir / "launch" / "curve.key").exists()
    for r in (0, 1):
        assert json.loads((tmp_path / f"w{r}.json").read_text())["final"] == expected(60, 1, 2)


# -- a lossy link -------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_lossy_link_with_resend_ends_with_the_clean_weights(cluster):
    steps, nkeys, workers = 30, 3, 2
    proxy_port = free_port()
    c = cluster(num_servers=1, num_workers=workers, PS_RESEND="1", PS_RESEND_TIMEOUT="300")
    c.start("scheduler", "scheduler", [sys.executable, "-m", "tfkv.ps.node"])
    # The server registers the proxy's address: every worker's request and every reply crosses it.
    c.start("server 0", "server", [sys.executable, "-m", "tfkv.ps.node"], TFKV_RANK_HINT="0",
            TFKV_ADVERTISE_ADDRESS=f"127.0.0.1:{proxy_port}")
    proxy = LossyProxy(proxy_port, lambda: "tcp://%s:%d" % c.listening("server 0"), seed=7)
    try:
        outs = c.start_workers("int_sgd", str(steps), str(nkeys), "32")
        codes = c.wait(180)
    finally:
        proxy.stop.set()
        proxy.thread.join(10)
    assert all(v == 0 for v in codes.values()), c.outputs()
    assert proxy.stats["dropped"] > 5 and proxy.stats["duplicated"] > 5 and proxy.stats["delayed"] > 5, proxy.stats
    # A clean run of int_sgd ends exactly here (integer sums; tests/ps/test_soak.py runs it clean).
    for out in outs:
        assert json.loads(out.read_text())["final"] == expected(steps, nkeys, workers)


def _curve_stranger(port: int, claim: int, send: int, result: dict) -> None:
    """A peer without keys on a raw TCP socket: the ZMTP 3 greeting announcing CURVE, then a
    handshake command frame that claims `claim` bytes, of which it streams up to `send` (0: it
    stalls after the frame's header). Records what it sent and whether the node hung up."""
    import socket

    greeting = b"\xff" + b"\0" * 8 + b"\x7f" + bytes([3, 0]) + b"CURVE".ljust(20, b"\0") + b"\0" + b"\0" * 31
    result.update(sent=0, closed=False, streamed=False, started=time.monotonic())
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        try:
            s.sendall(greeting)
            s.recv(64)  # the node's greeting (its first part: the rest may follow later)
            s.sendall(b"\x06" + claim.to_bytes(8, "big"))  # a long command frame
            block = b"\0" * (1 << 16)
            while result["sent"] < send:
                s.sendall(block)
                result["sent"] += len(block)
            result["streamed"] = True
            s.settimeout(30)
            while s.recv(4096):  # the rest of the node's greeting, if any, until it hangs up (or 30 s)
                pass
            result["closed"] = True
        except (ConnectionResetError, BrokenPipeError):
            result["closed"] = True
        except socket.timeout:
            pass
    result["streamed"] = True
    result["ended"] = time.monotonic()


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


@pytest.mark.slow
def test_strangers_cannot_make_a_server_buffer_unauthenticated_frames(cluster):
    """20 strangers at once announce CURVE and stream a handshake frame claiming 1 GiB (64 MiB of
    it sent each): the server hangs up on each early, its memory stays within 100 MiB of idle,
    a stranger that stalls mid-handshake is dropped by the handshake timeout, and the job ends
    with exact values."""
    steps = 400  # 0.05 s apart: the job outlasts the strangers and the handshake timeout
    c = cluster(num_servers=1, num_workers=2)
    c.start_servers()
    outs = c.start_workers("int_sgd", str(steps), "1", "64", "0.05")
    _, port = c.listening("server 0")
    pid = c.procs["server 0"].pid
    time.sleep(1.5)  # the job is under way
    idle = _rss_mib(pid)
    stalled: dict = {}
    threads = [threading.Thread(target=_curve_stranger, args=(port, 1 << 30, 0, stalled), daemon=True)]
    results = [{} for _ in range(20)]
    threads += [threading.Thread(target=_curve_stranger, args=(port, 1 << 30, 64 << 20, r), daemon=True)
                for r in results]
    for t in threads:
        t.start()
    peak = idle
    while not all(r.get("streamed") for r in results):  # what they sent is in the server by now
        assert c.procs["server 0"].poll() is None, c.outputs()
        peak = max(peak, _rss_mib(pid))
        time.sleep(0.02)
    time.sleep(0.5)
    peak = max(peak, _rss_mib(pid))
    print(f"server RSS: idle {idle:.0f} MiB, peak {peak:.0f} MiB with 20 strangers")
    assert peak - idle < 100, f"server grew from {idle:.0f} to {peak:.0f} MiB before authentication"
    while any(t.is_alive() for t in threads):
        assert c.procs["server 0"].poll() is None, c.outputs()
        time.sleep(0.1)
    assert all(r["closed"] for r in results), results
    assert all(r["sent"] < 8 << 20 for r in results), "the server read far more than its frame cap"
    assert stalled["closed"] and stalled["ended"] - stalled["started"] < 25, stalled
    codes = c.wait(120)
    assert all(v == 0 for v in codes.values()), c.outputs()
    for out in outs:
        assert json.loads(out.read_text())["final"] == expected(steps, 1, 2)


def _flood(address: str, count: int, pid: int) -> tuple[int, float]:
    """A stranger (plain TCP, no keys) that sends `count` malformed requests, each answered by an
    ERROR of about 4 KB, and never reads one. Returns how many it sent and the node's peak RSS."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 1)  # it reads nothing: what it is sent stays queued at the node
    sock.setsockopt(zmq.RCVBUF, 4096)
    sock.setsockopt(zmq.SNDTIMEO, 10_000)
    sock.connect(address)
    fields = {f"zz_{i:04d}_{'x' * 24}": 1 for i in range(300)}  # every unknown field is named
    bad = [bytes(f) for f in P.encode(P.Message(P.Type.SET_OPTIMIZER, sender=1, seq=1, meta={
        "optimizer": {"name": "sgd", **fields}}))]
    peak, sent = 0.0, 0
    try:
        for sent in range(1, count + 1):
            sock.send_multipart(bad)
            if sent % 1000 == 0:
                peak = max(peak, _rss_mib(pid))
    except zmq.Again:
        pass  # the node stopped reading: its RSS is what the test measures
    for _ in range(20):  # what was sent is processed by now
        time.sleep(0.1)
        peak = max(peak, _rss_mib(pid))
    sock.close()
    return sent, peak


@pytest.mark.slow
def test_a_stranger_that_never_reads_cannot_grow_a_node_without_bound(cluster):
    """Plain TCP, where a stranger's bytes reach the decoder: 20,000 malformed requests (80 MB of
    ERROR replies if each were answered) to the scheduler before the cluster formed and to a
    server while the job runs, from a peer that never reads. Each node grows by under 30 MiB,
    and the job ends with exact values."""
    steps, flood = 400, 20_000
    c = cluster(num_servers=1, num_workers=1, TFKV_SECURE="0")
    c.start("scheduler", "scheduler", [sys.executable, "-m", "tfkv.ps.node"])
    pid = c.procs["scheduler"].pid
    time.sleep(2)  # imported and listening
    idle = _rss_mib(pid)
    sent, peak = _flood(f"tcp://127.0.0.1:{c.env['DMLC_PS_ROOT_PORT']}", flood, pid)
    print(f"scheduler RSS: idle {idle:.0f} MiB, peak {peak:.0f} MiB after {sent} malformed messages")
    assert c.procs["scheduler"].poll() is None, c.output("scheduler")[-3000:]
    assert sent == flood and peak - idle < 30, f"the scheduler grew from {idle:.0f} to {peak:.0f} MiB"
    c.start("server 0", "server", [sys.executable, "-m", "tfkv.ps.node"], TFKV_RANK_HINT="0")
    (out,) = c.start_workers("int_sgd", str(steps), "1", "8", "0.05")
    host, port = c.listening("server 0")
    pid = c.procs["server 0"].pid
    time.sleep(1.5)  # the job is under way
    idle = _rss_mib(pid)
    sent, peak = _flood(f"tcp://{host}:{port}", flood, pid)
    print(f"server RSS: idle {idle:.0f} MiB, peak {peak:.0f} MiB after {sent} malformed messages")
    assert sent == flood and peak - idle < 30, f"the server grew from {idle:.0f} to {peak:.0f} MiB"
    codes = c.wait(120)
    assert all(v == 0 for v in codes.values()), c.outputs()
    assert json.loads(out.read_text())["final"] == expected(steps, 1, 1)
    assert len(c.output("server 0")) < 1 << 20, "the server logged every stranger's message"


def test_the_job_key_helpers_load_no_runtime_and_write_a_keyfile(tmp_path):
    """The launcher makes and hands over keys through tfkv.keys: it must load without the
    parameter-server runtime, and `python -m tfkv.keys KEYFILE` writes a usable key file."""
    code = ("import sys, tfkv.keys\n"
            "print(sorted(m for m in sys.modules if m.startswith(('tfkv.ps', 'tfkv.store', 'tensorflow'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    path = tmp_path / "job.key"
    subprocess.run([sys.executable, "-m", "tfkv.keys", str(path)], check=True, capture_output=True)
    assert job_keys.keys_from_env({job_keys.KEYFILE: str(path)}) is not None


# -- the data plane's cipher where `aeg` is missing -------------------------------------------------


def _hiding_aeg(tmp_path) -> dict[str, str]:
    """The environment of a process for which `import aeg` fails, as on Linux aarch64, musl or an
    Intel Mac, where the package has no wheel (tests/handshakes.without_aeg)."""
    import handshakes

    return {"PYTHONPATH": os.pathsep.join([str(handshakes.without_aeg(tmp_path)), os.environ.get("PYTHONPATH", "")])}


@pytest.mark.slow
@pytest.mark.parametrize("without", ["every node", "the server", "worker 1"])
def test_a_secure_job_runs_where_aeg_is_missing_on_aes_gcm(cluster, tmp_path, without):
    """`aeg` absent on every node, on the server only, or on one worker only: the job runs
    secure and ends exact; a connection is sealed with AEGIS-128X4 where both its ends have it,
    with AES-256-GCM otherwise."""
    steps = 20
    hidden = _hiding_aeg(tmp_path)
    c = cluster(num_servers=1, num_workers=2, **(hidden if without == "every node" else {}))
    c.start("scheduler", "scheduler", [sys.executable, "-m", "tfkv.ps.node"])
    c.start("server 0", "server", [sys.executable, "-m", "tfkv.ps.node"], TFKV_RANK_HINT="0",
            **(hidden if without == "the server" else {}))
    outs = []
    for i in range(2):
        outs.append(tmp_path / f"worker{i}.json")
        c.start(f"worker {i}", "worker", [sys.executable, WORKER, "int_sgd", str(outs[-1]), str(steps), "1", "16"],
                TFKV_RANK_HINT=str(i), **(hidden if without == "worker 1" and i == 1 else {}))
    codes = c.wait(120)
    assert all(v == 0 for v in codes.values()), c.outputs()
    for out in outs:
        assert json.loads(out.read_text())["final"] == expected(steps, 1, 2)
    ciphers = {"every node": "AES-256-GCM: 2", "the server": "AES-256-GCM: 2",
               "worker 1": "AEGIS-128X4: 1, AES-256-GCM: 1"}[without]
    assert f"data plane connections by cipher: {ciphers}" in c.output("server 0"), c.output("server 0")[-3000:]
    assert (tmp_path / "aeg-imports.log").exists()  # it was looked for, and missed
    assert "Traceback" not in c.outputs()


@pytest.mark.slow
def test_a_plain_job_never_imports_aeg(cluster, tmp_path):
    """With security off no process of the job (scheduler, server, workers) so much as tries to
    import `aeg`: tfkv.ps.aead imports it at the first secure handshake only."""
    c = cluster(num_servers=1, num_workers=2, TFKV_SECURE="0", **_hiding_aeg(tmp_path))
    c.start_servers()
    outs = c.start_workers("int_sgd", "5", "1", "8")
    codes = c.wait(120)
    assert all(v == 0 for v in codes.values()), c.outputs()
    for out in outs:
        assert json.loads(out.read_text())["final"] == expected(5, 1, 2)
    assert not (tmp_path / "aeg-imports.log").exists(), (tmp_path / "aeg-imports.log").read_text()
