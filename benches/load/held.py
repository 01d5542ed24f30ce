#!/usr/bin/env python3
"""What held calls cost: the server's resident set before and after C connections each open S
header-only streams (calls whose bodies never come), read from /proc two seconds later. Speaks
HTTP/2 with PyPI's `h2`; every loop is bounded by C and S, and the server (pinned to core 0, as
the load benchmark starts it) stops with the script.

    python3 benches/load/held.py BIN CONNECTIONS STREAMS    # e.g. target/debug/sluice 1 1024
"""

import socket
import sys
import time
from pathlib import Path

import h2.config
import h2.connection

sys.path.insert(0, str(Path(__file__).parent))
import run  # noqa: E402  (the load benchmark's helpers)


def rss_kib(pid):
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS")).split()[1])


def main():
    binary, conns, streams = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    policies = Path(__file__).parent.parent.parent / "config" / "policies"
    headers = [(":method", "POST"), (":scheme", "http"), (":authority", "sluice"),
               (":path", run.RLS_PATH), ("content-type", "application/grpc"), ("te", "trailers")]
    sockets = []
    with run.serving(binary, str(policies)) as server:
        try:
            time.sleep(0.5)
            before = rss_kib(server.proc.pid)
            for _ in range(conns):
                sock = socket.create_connection(("127.0.0.1", server.grpc))
                conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
                conn.initiate_connection()
                for _ in range(streams):
                    conn.send_headers(conn.get_next_available_stream_id(), headers)
                sock.sendall(conn.data_to_send())
                sockets.append(sock)
            time.sleep(2)
            after = rss_kib(server.proc.pid)
        finally:
            for sock in sockets:
                sock.close()
    print(f"{conns} x {streams} held streams: RSS {before / 1024:.1f} -> {after / 1024:.1f} MiB,"
          f" {(after - before) / (conns * streams):.2f} KiB per stream")


if __name__ == "__main__":
    main()
