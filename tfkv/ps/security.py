"""ZeroMQ CURVE on the control plane of a job (the scheduler's socket and every node's link to
it): authentication and encryption with the job's keys. The data plane (workers <-> servers)
is a plain socket whose every message is sealed with AEGIS-128X4 or AES-256-GCM (tfkv.ps.channel),
keyed from the same job keys; SECURITY.md has the threat model.

One keypair per job, made fresh by the launcher (tfkv.keys: making, handing over, reading keys). Every process of the job gets it
privately, never on a command line:

    TFKV_CURVE_PUBLIC, TFKV_CURVE_SECRET   the keypair, Z85 text (40 characters each), in the
                                           process's environment (local launcher, test helper;
                                           the ssh launcher sends them over the ssh channel's
                                           stdin and its wrapper puts them in the role's env)
    TFKV_CURVE_KEYFILE=path                or a file with the two lines "public=...",
                                           "secret=...", readable only by its owner (mode 0600;
                                           anything looser is refused)
    TFKV_SECURE=0                          plain TCP, no keys: only for a trusted single machine

The scheduler's socket is a CURVE server with the job's secret key, and a ZAP handler in the
process lets in only clients that present the job's public key: a peer without the keys fails
the handshake inside libzmq and none of its bytes reaches tfkv code. Scheduler links are CURVE
clients of the same keypair.

No keys and no TFKV_SECURE=0 (a job started by hand with MXNet's DMLC_* variables only): plain
TCP with a warning, as MXNet users expect. TFKV_SECURE=1 without keys is an error.

What a connection can cost a node before it authenticates is bounded on every socket, secure
or not: no frame over protocol.MAX_FRAME (1 MiB + 4 KiB) is accepted (libzmq's ZMQ_MAXMSGSIZE holds for
the handshake's frames too; a stranger announcing CURVE and a 1 GiB frame is cut off after
1 MiB), and a handshake not finished within HANDSHAKE_SECONDS is dropped. The one exception is
a plain job's data plane (TFKV_SECURE=0, where anyone who connects may push anyway): its sockets
take payloads as single frames up to the largest a server accepts (protocol.max_frame).
"""

from __future__ import annotations

import logging
import threading

import zmq

from tfkv.keys import Keys, SecurityError  # noqa: F401  (SecurityError: the error this module's callers catch)
from tfkv.ps.protocol import MAX_FRAME

HANDSHAKE_SECONDS = 10  # a CURVE handshake takes milliseconds; a stalled one holds its buffers

_auth_lock = threading.Lock()
_authenticators: dict[int, object] = {}


class _AllowJobKey:
    """ZAP credentials check: only the job's public key gets in."""

    def __init__(self, public: bytes):
        self.public = public  # Z85, as pyzmq hands the client's key to the callback

    def callback(self, domain: str, key: bytes) -> bool:
        return domain == "tfkv" and key == self.public


def _start_authenticator(ctx: zmq.Context, keys: Keys) -> None:
    """One ZAP handler per context (so per process), started before the first bind."""
    with _auth_lock:
        if id(ctx) in _authenticators:
            return
        from zmq.auth.thread import ThreadAuthenticator

        auth = ThreadAuthenticator(ctx, log=logging.getLogger("tfkv.zap"))
        auth.start()
        auth.configure_curve_callback(domain="tfkv", credentials_provider=_AllowJobKey(keys.public))
        _authenticators[id(ctx)] = auth


def _bound(sock: zmq.Socket, max_frame: int) -> None:
    """Cap what a peer can make this socket buffer (per frame, the handshake's included) and how
    long it may take to authenticate."""
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame)
    sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_SECONDS * 1000)


def server_socket(sock: zmq.Socket, keys: Keys | None, max_frame: int = MAX_FRAME) -> None:
    """Make a listening socket a CURVE server that admits the job's key only (before bind); with
    or without keys, bound what an unauthenticated peer can make it buffer."""
    _bound(sock, max_frame)
    if keys is None:
        return
    _start_authenticator(sock.context, keys)
    sock.setsockopt(zmq.ZAP_DOMAIN, b"tfkv")
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_server = True


def router_socket(keys: Keys | None, max_frame: int = MAX_FRAME) -> zmq.Socket:
    """A node's listening socket (the scheduler's, a server's), before bind: a CURVE server
    (`server_socket`) whose replies are never dropped. ZeroMQ's ROUTER silently drops what
    exceeds a peer's high-water mark (1,000 messages by default: the replies to a pull of 10,000
    keys; a lost BARRIER_DONE or FAILED would hang a node that still heartbeats), so there is
    none: every queued reply answers a request that peer made and will read, and a connection no
    member spoke on gets a few answers at most (tfkv.ps.strangers)."""
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.setsockopt(zmq.SNDHWM, 0)
    server_socket(sock, keys, max_frame)
    return sock


def client_socket(sock: zmq.Socket, keys: Keys | None, max_frame: int = MAX_FRAME) -> None:
    """Make a connecting socket a CURVE client of the job (before connect), its frames bounded
    as a server's."""
    _bound(sock, max_frame)
    if keys is None:
        return
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_serverkey = keys.public


if __name__ == "__main__":  # the key-file entry moved to tfkv.keys; this name keeps working
    import sys

    from tfkv.keys import main

    main(sys.argv[1:])
