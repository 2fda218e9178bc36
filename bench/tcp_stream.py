"""One TCP stream, the yardstick for the emulated cluster's links.

    python bench/tcp_stream.py receive --port 5201      (prints MB/s when done)
    python bench/tcp_stream.py send --host ADDR --port 5201 --seconds 5

The receiver times from the first byte to the last, so connection set-up and
the sender's start-up do not count; MB/s means 10^6 bytes per second.
"""

import argparse
import socket
import time

BLOCK = 1 << 20


def receive(port):
    with socket.create_server(("", port)) as server:
        conn, _ = server.accept()
        with conn:
            buf = bytearray(BLOCK)
            view = memoryview(buf)
            conn.recv_into(view)
            start = time.perf_counter()
            total = 0
            while True:
                n = conn.recv_into(view)
                if n == 0:
                    break
                total += n
            elapsed = time.perf_counter() - start
    print(repr(total / elapsed / 1e6))  # unrounded: benchmarks divide by it


def send(host, port, seconds):
    payload = bytes(BLOCK)
    with socket.create_connection((host, port)) as conn:
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            conn.sendall(payload)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mode", required=True)
    rx = sub.add_parser("receive")
    rx.add_argument("--port", type=int, default=5201)
    tx = sub.add_parser("send")
    tx.add_argument("--host", required=True)
    tx.add_argument("--port", type=int, default=5201)
    tx.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    if args.mode == "receive":
        receive(args.port)
    else:
        send(args.host, args.port, args.seconds)


if __name__ == "__main__":
    main()
