"""A small HTTP/1.1 server for the demo and the tests: keep-alive, chunked, errors, TLS.

Usage: demo_server.py PORT [KEYFILE CERTFILE]   (TLS when the key and cert are given)

Endpoints: /status/NNN (that status), /slow (300 ms), /chunked (three chunks,
20 ms apart), POST anything (echoes the body size), anything else: 200.
"""

from __future__ import annotations

import http.server
import socketserver
import ssl
import sys
import time


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - base signature
        pass

    def _send(self, code: int, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _chunked(self) -> None:
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for part in (b"alpha", b"beta", b"gamma"):
            self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
            self.wfile.flush()
            time.sleep(0.02)
        self.wfile.write(b"0\r\n\r\n")

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if self.path.startswith("/status/"):
            code = int(self.path.split("/")[2])
            self._send(code, b"status %d\n" % code)
        elif self.path == "/slow":
            time.sleep(0.3)
            self._send(200, b"slow\n")
        elif self.path == "/chunked":
            self._chunked()
        else:
            self._send(200, b"ok " + self.path.encode() + b"\n")

    def do_POST(self) -> None:  # noqa: N802
        n = int(self.headers.get("Content-Length", 0))
        body = self.rfile.read(n)
        self._send(200, b"got %d\n" % len(body))


class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True


def main(argv: list[str]) -> None:
    srv = Server(("127.0.0.1", int(argv[1])), Handler)
    if len(argv) > 3:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(argv[3], argv[2])
        srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
    print("ready", flush=True)
    srv.serve_forever()


if __name__ == "__main__":
    main(sys.argv)
