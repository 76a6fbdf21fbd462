"""What ``convnets serve``'s front costs, for ``benchmarks/bench_serve.py``: the same requests through the front's TCP
ports and straight to Triton's own unix sockets, on one server.

A tiny SE-ResNeXt (an eighth of the width, 5 classes, random weights) is served with ``--engine torch``, and each
request carries one 256x256 JPEG: Triton's own work per request is small, so the front's share shows. For each
protocol and number of clients:

* ``HTTP``: N threads, each with one kept-alive connection, send a KServe v2 binary request (the JSON header, then
  the image as binary tensor data, as tritonclient sends it); the same client code on a TCP socket (the front) or
  on Triton's unix socket;
* ``gRPC``: the same with ``tritonclient.grpc`` (one client per thread), at ``127.0.0.1:PORT`` or
  ``unix:DIR/grpc:2``;
* at one client the two routes alternate request by request (a burst of the machine's other load falls on both);
  at more, each round measures the routes back to back in a rotated order, ``requests`` requests each;
* ``readiness``: 8 threads on ``GET /v2/health/ready`` for ``seconds``: requests per second.

Reported per row: requests/s per route (median of the rounds) and their ratio (median of the rounds' ratios),
latency p50 / p99 per route over all rounds, the ratio of the p99s (at one client, of all rounds' requests;
at more, the median of the rounds' ratios, as for throughput), and the CPU time the front's process spends per
request as a share of what Triton and its backend stub spend per request. Target: the front costs at
most 5 %, a throughput ratio of at least 0.95 and a p99 ratio of at most 1.05. The clients share the server's
cores.
"""

from __future__ import annotations

import io
import json
import logging
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

log = logging.getLogger("bench_serve")

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




def alternate(routes: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]], requests: int) -> dict[str, list[float]]:
    """One client sending ``requests`` requests to each route in turn, request by request (the order flipped each
    time); each route's latencies in ms."""
    connections = {name: make() for name, (make, _) in routes.items()}
    latencies: dict[str, list[float]] = {name: [] for name in routes}
    names = list(routes)
    for i in range(requests):
        for name in names if i % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            routes[name][1](connections[name])
            latencies[name].append(1000 * (time.perf_counter() - start))
    for connection in connections.values():
        connection.close()
    return latencies


def measure(server_pid: int, http_port: int, grpc_port: int, clients: list[int], requests: int, rounds: int,
            seconds: float) -> dict[str, Any]:
    """The front's cost on the running tiny-model server ``server_pid`` (see the module doc)."""
    import psutil

    image = jpeg()
    http_socket, grpc_socket = triton_sockets(server_pid)
    front_process = psutil.Process(server_pid)
    (triton,) = [p for p in front_process.children() if p.name() == "tritonserver"]
    tritons = [triton, *triton.children(recursive=True)]  # with the backend's stub
    data = infer_request(image)
    routes = {("HTTP", "front"): http_route(("127.0.0.1", http_port), data),
              ("HTTP", "socket"): http_route(http_socket, data),
              ("gRPC", "front"): grpc_route(f"127.0.0.1:{grpc_port}", image),
              ("gRPC", "socket"): grpc_route(grpc_socket, image)}
    for route in routes.values():  # warm-up
        run_clients(*route, 8, 64)

    def used(since: tuple[float, float] = (0.0, 0.0)) -> tuple[float, float]:
        """CPU seconds of the front's process, and of Triton with its stub, since ``since``."""
        return cpu_seconds([front_process]) - since[0], cpu_seconds(tritons) - since[1]

    speed: dict[tuple[str, int, str], list[float]] = {}
    latency: dict[tuple[str, int, str], list[list[float]]] = {}
    cpu: dict[tuple[str, int], list[float]] = {}
    ready: dict[str, list[float]] = {"front": [], "socket": []}
    for r in range(rounds):
        for protocol in ("HTTP", "gRPC"):
            for n in clients:
                pair = {where: routes[(protocol, where)] for where in ("front", "socket")}
                if n == 1:
                    start = used()
                    ms = alternate(pair, requests)
                    per_s = {where: 1000 * len(values) / sum(values) for where, values in ms.items()}
                    front_cpu, triton_cpu = used(start)
                    triton_cpu /= 2  # Triton answered both routes' requests
                else:
                    per_s, ms = {}, {}
                    for where in ["front", "socket"] if (r + n) % 2 == 0 else ["socket", "front"]:
                        start = used()
                        per_s[where], ms[where] = run_clients(*pair[where], n, requests)
                        if where == "front":  # Triton's CPU on the front's requests only
                            front_cpu, triton_cpu = used(start)
                cpu.setdefault((protocol, n), []).append(front_cpu / triton_cpu)
                for where in ("front", "socket"):
                    speed.setdefault((protocol, n, where), []).append(per_s[where])
                    latency.setdefault((protocol, n, where), []).append(ms[where])
                log.info("round %d %s %d clients: front %.0f/s, socket %.0f/s", r + 1, protocol, n,
                         per_s["front"], per_s["socket"])
        for where in ["front", "socket"] if r % 2 == 0 else ["socket", "front"]:
            ready[where].append(readiness(("127.0.0.1", http_port) if where == "front" else http_socket, seconds))
    rows = []
    for protocol in ("HTTP", "gRPC"):
        for n in clients:
            front, sock = (speed[(protocol, n, where)] for where in ("front", "socket"))
            ratios = [f / s for f, s in zip(front, sock)]
            rounds_ms = {where: latency[(protocol, n, where)] for where in ("front", "socket")}
            p = {where: np.percentile(sum(ms, []), [50, 99]).tolist() for where, ms in rounds_ms.items()}
            # Alternating routes share every burst of other load: the p99s of all requests compare. Routes measured
            # one after the other do not: the median of the rounds' p99 ratios leaves out a round a burst hit.
            p99_ratio = p["front"][1] / p["socket"][1] if n == 1 else statistics.median(
                np.percentile(f, 99) / np.percentile(s, 99) for f, s in zip(rounds_ms["front"], rounds_ms["socket"]))
            rows.append({"protocol": protocol, "clients": n, "front_per_s": statistics.median(front),
                         "socket_per_s": statistics.median(sock), "ratio": statistics.median(ratios),
                         "ratio_min_max": [min(ratios), max(ratios)], "front_p50_p99_ms": p["front"],
                         "socket_p50_p99_ms": p["socket"], "p99_ratio": float(p99_ratio),
                         "front_cpu_vs_triton": statistics.median(cpu[(protocol, n)])})
    return {"model": "tiny se_resnext101_32x4d (1/8 width), engine torch", "image": "256x256 JPEG",
            "requests": requests, "rounds": rounds, "target_ratio": TARGET, "rows": rows,
            "readiness_per_s": {where: statistics.median(v) for where, v in ready.items()}, "readiness_clients": 8}
