"""What ``convnets serve``'s front costs: the same requests through the front's TCP ports and straight to Triton's
own unix sockets, on one server.

Usage (with the serve extra installed: ``pip install -c constraints.txt -e '.[serve]'``)::

    python benchmarks/bench_serve_front.py                  # HTTP and gRPC, 1/8/64 clients, 8 rounds
    python benchmarks/bench_serve_front.py --rounds 1 --requests 100    # a quick check

A tiny SE-ResNeXt (an eighth of the width, 5 classes, random weights) is served with ``--engine torch``, and
each request carries one 256x256 JPEG: Triton's own work per request is small, so the front's share shows.
For each protocol and number of clients, rounds interleave the two routes in a rotated order:

* ``HTTP``: N threads here, each with one kept-alive connection, send a KServe v2 binary request (the JSON
  header, then the image as binary tensor data, as tritonclient sends it) until ``--requests`` requests are
  answered; the same client code on a TCP socket (the front) or on Triton's unix socket;
* ``gRPC``: the same with ``tritonclient.grpc`` (one client per thread), at ``127.0.0.1:PORT`` or
  ``unix:DIR/grpc:2``;
* ``readiness``: 8 threads on ``GET /v2/health/ready`` for ``--seconds``: requests per second.

Reported: requests/s and latency p50 / p99 per route (of all rounds' latencies), and front / socket ratios
(throughput and p99: the median of the rounds' ratios, each round's two routes measured back to back, so that a
burst of the machine's other load weighs on one round, not on one route), and the CPU time the front's process spent per request as a share
of what Triton and its backend stub spent (on the front route; a figure that the machine's other load changes far
less than the throughput). Target: the front costs at most 5 %, i.e. a throughput ratio
of at least 0.95 and a p99 ratio of at most 1.05 at 1, 8 and 64 clients. The clients share the server's
cores; the load average before and after is recorded.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import re
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import convnets  # noqa: E402
from convnets.deploy.benchmark import environment  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import results  # noqa: E402
from bench_serve import start_server  # noqa: E402

log = logging.getLogger("bench_serve_front")

REPO = Path(__file__).resolve().parents[1]
TARGET = 0.95


def tiny_checkpoint(folder: Path) -> Path:
    """A self-describing SE-ResNeXt checkpoint an eighth of the width, 5 classes, random weights (made once)."""
    path = folder / "tiny-se.pth.tar"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(0)
        model = convnets.get_model("se_resnext101_32x4d", num_classes=5, layers=[1, 2, 1, 1], widths=[32, 64, 128, 256],
                                   cardinality=4)
        torch.save({"state_dict": model.state_dict(), "arch_spec": model.spec.to_dict(),
                    "class_names": ["a", "b", "c", "d", "e"]}, path)
    return path


def jpeg() -> bytes:
    image = Image.open(REPO / "examples" / "rocket.jpg").convert("RGB").resize((256, 256))
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


def cpu_seconds(processes: list[Any]) -> float:
    """User and system CPU seconds of psutil ``processes`` so far."""
    return sum(sum(p.cpu_times()[:2]) for p in processes)


def triton_sockets(server_pid: int) -> tuple[str, str]:
    """Triton's own HTTP socket path and gRPC target (``unix:PATH:PORT``), from its command line."""
    import psutil

    (triton,) = [p for p in psutil.Process(server_pid).children() if p.name() == "tritonserver"]
    options = dict(arg[2:].split("=", 1) for arg in triton.cmdline() if arg.startswith("--") and "=" in arg)
    return options["http-address"].removeprefix("unix:"), f"{options['grpc-address']}:{options['grpc-port']}"


class RawHTTP:
    """One kept-alive HTTP/1.1 connection (TCP or unix), reading answers by their Content-Length."""

    def __init__(self, address: tuple[str, int] | str) -> None:
        if isinstance(address, str):
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        else:
            self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.connect(address)
        self.buffer = b""

    def request(self, data: bytes) -> int:
        self.sock.sendall(data)
        while b"\r\n\r\n" not in self.buffer:
            self.buffer += self.sock.recv(1 << 16)
        head, _, self.buffer = self.buffer.partition(b"\r\n\r\n")
        length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))  # type: ignore[union-attr]
        while len(self.buffer) < length:
            self.buffer += self.sock.recv(1 << 16)
        self.buffer = self.buffer[length:]
        return int(head.split(b" ", 2)[1])

    def close(self) -> None:
        self.sock.close()


def infer_request(image: bytes) -> bytes:
    header = json.dumps({"inputs": [{"name": "image", "datatype": "BYTES", "shape": [1, 1],
                                     "parameters": {"binary_data_size": 4 + len(image)}}],
                         "outputs": [{"name": "top_indices", "parameters": {"binary_data": True}}]}).encode()
    body = header + len(image).to_bytes(4, "little") + image
    return (b"POST /v2/models/bench/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
            b"Inference-Header-Content-Length: %d\r\nContent-Length: %d\r\n\r\n" % (len(header), len(body))) + body


def run_clients(make: Callable[[], Any], send: Callable[[Any], None], clients: int, requests: int) -> tuple[float, list[float]]:
    """``clients`` threads, each with ``make()``'s connection, call ``send`` until ``requests`` are answered."""
    connections = [make() for _ in range(clients)]
    left = [requests]
    lock = threading.Lock()
    latencies: list[float] = []

    def client(connection: Any) -> None:
        mine = []
        while True:
            with lock:
                if left[0] <= 0:
                    break
                left[0] -= 1
            start = time.perf_counter()
            send(connection)
            mine.append(1000 * (time.perf_counter() - start))
        with lock:
            latencies.extend(mine)
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, connections))
    seconds = time.perf_counter() - start
    for connection in connections:
        connection.close()
    return requests / seconds, latencies


def http_route(address: tuple[str, int] | str, data: bytes) -> tuple[Callable[[], Any], Callable[[Any], None]]:
    def send(connection: RawHTTP) -> None:
        assert connection.request(data) == 200
    return lambda: RawHTTP(address), send


def grpc_route(url: str, image: bytes) -> tuple[Callable[[], Any], Callable[[Any], None]]:
    import tritonclient.grpc as grpcclient

    def send(client: Any) -> None:
        tensor = grpcclient.InferInput("image", [1, 1], "BYTES")
        tensor.set_data_from_numpy(np.array([[image]], dtype=object))
        client.infer("bench", [tensor], outputs=[grpcclient.InferRequestedOutput("top_indices")])
    return lambda: grpcclient.InferenceServerClient(url), send


def readiness(address: tuple[str, int] | str, seconds: float, clients: int = 8) -> float:
    request = b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n"
    done = [0]
    lock = threading.Lock()
    end = time.perf_counter() + seconds

    def client() -> None:
        connection, count = RawHTTP(address), 0
        while time.perf_counter() < end:
            assert connection.request(request) == 200
            count += 1
        connection.close()
        with lock:
            done[0] += count
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(lambda _: client(), range(clients)))
    return done[0] / (time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--requests", type=int, default=256, help="requests per measurement (default 256)")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=3.0, help="seconds per readiness measurement (default 3)")
    parser.add_argument("--folder", type=Path, default=Path("/tmp/convnets_bench_serve"))
    parser.add_argument("--serve-python", default=sys.executable,
                        help="the interpreter that runs `convnets serve` (one with the serve extra; default: this one)")
    results.add_output_option(parser, "bench_serve_front")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    args.max_batch_size = 16

    args.engine, args.precision, args.max_queue_delay_ms = "torch", "fp32", 0.0
    image = jpeg()
    load_before = os.getloadavg()[0]
    server, http_port, grpc_port = start_server(args.serve_python, tiny_checkpoint(args.folder), args)
    try:
        import psutil

        http_socket, grpc_socket = triton_sockets(server.pid)
        front_process = psutil.Process(server.pid)
        (triton,) = [p for p in front_process.children() if p.name() == "tritonserver"]
        tritons = [triton, *triton.children(recursive=True)]  # with the backend's stub
        cpu: dict[tuple[str, int], list[float]] = {}
        data = infer_request(image)
        routes = {("HTTP", "front"): http_route(("127.0.0.1", http_port), data),
                  ("HTTP", "socket"): http_route(http_socket, data),
                  ("gRPC", "front"): grpc_route(f"127.0.0.1:{grpc_port}", image),
                  ("gRPC", "socket"): grpc_route(grpc_socket, image)}
        for route in routes.values():  # warm-up
            run_clients(*route, 8, 64)
        speed: dict[tuple[str, int, str], list[float]] = {}
        latency: dict[tuple[str, int, str], list[list[float]]] = {}
        ready: dict[str, list[float]] = {"front": [], "socket": []}
        for r in range(args.rounds):
            for protocol in ("HTTP", "gRPC"):
                for clients in args.clients:
                    order = ["front", "socket"] if (r + clients) % 2 == 0 else ["socket", "front"]
                    for where in order:
                        before = cpu_seconds([front_process]), cpu_seconds(tritons)
                        per_s, ms = run_clients(*routes[(protocol, where)], clients, args.requests)
                        if where == "front":  # CPU seconds per request: the front's, and Triton's with its stub
                            cpu.setdefault((protocol, clients), []).append(
                                (cpu_seconds([front_process]) - before[0]) / (cpu_seconds(tritons) - before[1]))
                        speed.setdefault((protocol, clients, where), []).append(per_s)
                        latency.setdefault((protocol, clients, where), []).append(ms)
                    log.info("round %d %s %d clients: front %.0f/s, socket %.0f/s", r + 1, protocol, clients,
                             speed[(protocol, clients, "front")][-1], speed[(protocol, clients, "socket")][-1])
            for where in (["front", "socket"] if r % 2 == 0 else ["socket", "front"]):
                ready[where].append(readiness(("127.0.0.1", http_port) if where == "front" else http_socket,
                                              args.seconds))
    finally:
        server.send_signal(2)
        server.wait(timeout=120)
    rows = []
    for protocol in ("HTTP", "gRPC"):
        for clients in args.clients:
            front, sock = (speed[(protocol, clients, w)] for w in ("front", "socket"))
            ratios = [f / s for f, s in zip(front, sock)]
            p = {w: np.percentile(sum(latency[(protocol, clients, w)], []), [50, 99]).tolist()
                 for w in ("front", "socket")}
            p99_ratios = [np.percentile(f, 99) / np.percentile(s, 99)
                          for f, s in zip(*(latency[(protocol, clients, w)] for w in ("front", "socket")))]
            rows.append({"protocol": protocol, "clients": clients, "front_per_s": statistics.median(front),
                         "socket_per_s": statistics.median(sock), "ratio": statistics.median(ratios),
                         "ratio_min_max": [min(ratios), max(ratios)], "front_p50_p99_ms": p["front"],
                         "socket_p50_p99_ms": p["socket"], "p99_ratio": float(statistics.median(p99_ratios)),
                         "front_cpu_vs_triton": statistics.median(cpu[(protocol, clients)])})
    readiness_row = {w: statistics.median(v) for w, v in ready.items()}
    results.save(args.json, environment("cpu"), {
        "model": "tiny se_resnext101_32x4d (1/8 width), engine torch", "image": "256x256 JPEG",
        "requests": args.requests, "rounds": args.rounds, "target_ratio": TARGET,
        "load_average": [load_before, os.getloadavg()[0]], "rows": rows,
        "readiness_per_s": readiness_row, "readiness_clients": 8})
    for row in rows:
        print(row)
    print("readiness req/s", readiness_row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
