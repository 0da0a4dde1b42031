"""The parameter server's transport: one object per node owning its sockets, the secure handshake and
sealing, batching and resend, with secure or plain chosen once when it is made (ps-lite's Van).

`server.ServerTransport` is a server's (one ROUTER socket, every worker's connection); `worker.WorkerTransport`
a worker's (one DEALER socket per server). What travels in them is tfkv.ps.protocol's messages; the
rounds, the request tracking and the store sit above them and never see a socket or a session.
"""
