"""A plain-socket TCP transfer, to measure an emulated link: `recv ADDR PORT` prints the bits per
second it received (first byte to last), `send ADDR PORT SECONDS` sends zeros for that long."""

import socket
import sys
import time


def receive(address: str, port: int) -> None:
    with socket.create_server((address, port)) as server:
        print("listening", flush=True)
        conn, _ = server.accept()
        with conn:
            total, first = 0, None
            while chunk := conn.recv(1 << 20):
                first = first or time.monotonic()
                total += len(chunk)
            print(f"{total * 8 / (time.monotonic() - first):.0f}", flush=True)


def send(address: str, port: int, seconds: float) -> None:
    block = bytes(1 << 16)
    with socket.create_connection((address, port), timeout=10) as conn:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            conn.sendall(block)


if __name__ == "__main__":
    if sys.argv[1] == "recv":
        receive(sys.argv[2], int(sys.argv[3]))
    else:
        send(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
