"""A small PyTorch inference server on 127.0.0.1 (HTTP/1.1, keep-alive), for the GPU scenario.

GET /infer copies one pageable input batch to the GPU (16 MiB: 256 x 16384 float32), runs a
4-layer MLP built in code (no weights to download), copies 16 floats back and answers JSON.
The server counts its own copies so the scenario can check the traced bytes.

    python3 tests/gpu/server.py --port 8088
"""

from __future__ import annotations

import argparse
import json
import os
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

BATCH, FEATURES, HIDDEN = 256, 16384, 1024
INPUT_BYTES = BATCH * FEATURES * 4


def build() -> tuple[torch.nn.Module, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN), torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, 16),
    ).cuda().eval()
    inputs = [torch.randn(BATCH, FEATURES) for _ in range(4)]  # pageable host memory
    return model, inputs


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body in one segment: no delayed-ACK stalls
    wbufsize = 1 << 16  # http.server flushes once per response
    model: torch.nn.Module
    inputs: list[torch.Tensor]
    served = 0

    def do_GET(self) -> None:
        if self.path.startswith("/healthz"):
            self._send(200, {"ok": True, "pid": os.getpid(), "input_bytes": INPUT_BYTES})
            return
        if not self.path.startswith("/infer"):
            self._send(404, {"error": "not found"})
            return
        x = self.inputs[Handler.served % len(self.inputs)]
        Handler.served += 1
        with torch.no_grad():
            y = self.model(x.to("cuda"))  # H2D (pageable), 4 GEMMs + activations
            out = y[0].cpu()  # D2H + stream sync
        self._send(200, {"y": [round(float(v), 4) for v in out[:4]], "n": Handler.served})

    def _send(self, code: int, body: dict[str, object]) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=8088)
    a = ap.parse_args()
    Handler.model, Handler.inputs = build()
    with torch.no_grad():  # warm up: cuBLAS handles, kernels, the caching allocator
        for x in Handler.inputs * 5:
            Handler.model(x.to("cuda"))[0].cpu()
    srv = ThreadingHTTPServer(("127.0.0.1", a.port), Handler)
    print(f"ready pid={os.getpid()} port={a.port}", flush=True)
    srv.serve_forever()


if __name__ == "__main__":
    main()
