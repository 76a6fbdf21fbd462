"""``convnets serve`` under concurrent clients, against in-process ``predict`` on the same images and engine.

Usage (with the serve extra installed: ``pip install -c constraints.txt -e '.[serve]'``)::

    python benchmarks/bench_serve.py                           # SE-ResNeXt101, 1/8/32 clients, 3 rounds
    python benchmarks/bench_serve.py --model resnet50 --requests 32 --rounds 1    # a quick check

What it measures, with random weights (speed does not depend on them; a checkpoint is written once
to ``--folder`` so that the server and this process run the same weights, and the server's engine
loads from the engine cache):

* ``in process``: :func:`convnets.inference.predict.predict` over ``--requests`` JPEG files
  (decoding, preprocessing, the model, top-5) in batches of ``--max-batch-size``, on the engine the
  server picked (``--engine auto`` by default, as both commands do), decoding in this process as
  ``convnets predict`` does on a small machine;
* ``N clients``: ``convnets serve`` with the same options, and N threads here, each with its own
  ``tritonclient`` HTTP connection, sending one encoded image per request until ``--requests``
  images are answered: throughput (img/s), per-request latency p50 / p99 (over all rounds), the
  mean batch the dynamic batcher formed (Triton's statistics), and the throughput as a fraction
  of in-process in the same round (median, min-max).

Rounds interleave the variants in a rotated order. The clients run on the same cores as the server:
on a small machine their share of the CPU is part of what is measured, as is any other load on it.
Target: at least 0.8x in-process throughput at 8 clients or more.

``--front`` measures what the server's front costs instead (``benchmarks/results/bench_serve_front.json``):
the same requests through the front's TCP ports and straight to Triton's own unix sockets, on one server::

    python benchmarks/bench_serve.py --front              # HTTP and gRPC, 1/8/64 clients, 3 rounds

A tiny SE-ResNeXt (an eighth of the width, 5 classes, random weights) is served with ``--engine torch``, and
each request carries one 256x256 JPEG: Triton's own work per request is small, so the front's share shows.
For each protocol and number of clients, rounds interleave the two routes in a rotated order:

* ``HTTP``: N threads here, each with one kept-alive connection, send a KServe v2 binary request (the JSON
  header, then the image as binary tensor data, as tritonclient sends it) until ``--requests`` requests are
  answered; the same client code on a TCP socket (the front) or on Triton's unix socket;
* ``gRPC``: the same with ``tritonclient.grpc`` (one client per thread), at ``127.0.0.1:PORT`` or
  ``unix:DIR/grpc:2``;
* ``readiness``: 8 threads on ``GET /v2/health/ready`` for ``--seconds``: requests per second.

Reported: requests/s and latency p50 / p99 per route, and front / socket ratios (throughput: median of the
rounds' ratios; p99: of all rounds' latencies). Target: the front costs at most 5 %, i.e. a throughput ratio
of at least 0.95 and a p99 ratio of at most 1.05 at 1, 8 and 64 clients. The clients share the server's
cores; the load average before and after is recorded.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import queue
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageOps

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import convnets  # noqa: E402
from convnets.deploy.benchmark import environment  # noqa: E402
from convnets.deploy.optimize import optimize_for_inference  # noqa: E402
from convnets.inference.predict import class_labels, predict  # noqa: E402
from convnets.preprocessing.presets import preset_for_model  # noqa: E402
from convnets.registry import choose_model, load_model  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import results  # noqa: E402

log = logging.getLogger("bench_serve")

REPO = Path(__file__).resolve().parents[1]
TARGET_RATIO = 0.8
FRONT_TARGET = 0.95
_READY = re.compile(r"HTTP http://127\.0\.0\.1:(\d+), gRPC 127\.0\.0\.1:(\d+)")


def make_images(folder: Path, count: int) -> list[Path]:
    """``count`` JPEGs of about 500x375 (ImageNet's typical size), from the example photos: crops and flips."""
    folder.mkdir(parents=True, exist_ok=True)
    examples = sorted(p for p in (REPO / "examples").iterdir() if p.suffix in (".png", ".jpg"))
    paths = []
    for i in range(count):
        path = folder / f"photo{i:03d}.jpg"
        if not path.exists():
            image = Image.open(examples[i % len(examples)]).convert("RGB")
            w, h = image.size
            left, top = (i * 7) % max(1, w // 5), (i * 11) % max(1, h // 5)
            image = image.crop((left, top, left + w * 4 // 5, top + h * 4 // 5)).resize((500, 375))
            (ImageOps.mirror(image) if i % 2 else image).save(path, quality=90)
        paths.append(path)
    return paths


def make_checkpoint(folder: Path, model: str) -> Path:
    """Random weights (BatchNorm statistics measured on random inputs) in a checkpoint, made once."""
    path = folder / f"{model}-random.pth"
    if not path.exists():
        chosen = choose_model(model, pretrained=False)
        torch.save({"state_dict": chosen.model.state_dict(), "arch_spec": chosen.model.spec.to_dict()}, path)
    return path


def start_server(python: str, checkpoint: Path, args: argparse.Namespace) -> tuple[subprocess.Popen[str], int, int]:
    command = [python, "-m", "convnets", "serve", "--weights", str(checkpoint), "--name", "bench", "--engine",
               args.engine, "--precision", args.precision, "--max-batch-size", str(args.max_batch_size),
               "--max-queue-delay-ms", str(args.max_queue_delay_ms), "--http-port", "0", "--grpc-port", "0",
               "--metrics-port", "0"]
    log.info("starting %s", " ".join(command))
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, cwd=REPO,
                               env={**os.environ, "PYTHONPATH": str(REPO)})
    assert process.stdout is not None
    line = process.stdout.readline()
    ready = _READY.search(line)
    if not ready:
        process.kill()
        raise SystemExit(f"the server did not start: {line!r}")
    return process, int(ready.group(1)), int(ready.group(2))


def stats(port: int) -> tuple[int, int]:
    """Triton's (inference count, execution count) of the model so far."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/models/bench/stats", timeout=30) as response:
        model = json.load(response)["model_stats"][0]
    return int(model["inference_count"]), int(model["execution_count"])


def served_run(port: int, images: list[bytes], clients: int) -> tuple[float, list[float], float]:
    """``clients`` threads send one image per request until every image is answered.

    Returns:
        Images per second, each request's latency in ms, and the mean batch Triton executed.
    """
    import tritonclient.http as httpclient

    work: queue.Queue[bytes] = queue.Queue()
    for data in images:
        work.put(data)
    latencies: list[float] = []
    lock = threading.Lock()
    connections = [httpclient.InferenceServerClient(f"127.0.0.1:{port}", network_timeout=600)
                   for _ in range(clients)]

    def client(http: Any) -> None:
        while True:
            try:
                data = work.get_nowait()
            except queue.Empty:
                return
            tensor = httpclient.InferInput("image", [1, 1], "BYTES")
            tensor.set_data_from_numpy(np.array([[data]], dtype=object))
            start = time.perf_counter()
            http.infer("bench", [tensor], outputs=[httpclient.InferRequestedOutput("top_indices")])
            with lock:
                latencies.append(1000 * (time.perf_counter() - start))
    before = stats(port)
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, connections))
    seconds = time.perf_counter() - start
    after = stats(port)
    for http in connections:
        http.close()
    return len(images) / seconds, latencies, (after[0] - before[0]) / max(1, after[1] - before[1])


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


def front_main(args: argparse.Namespace) -> int:
    """``--front``: the front against Triton's own sockets (see the module doc)."""
    args.engine, args.precision, args.max_queue_delay_ms = "torch", "fp32", 0.0
    image = jpeg()
    load_before = os.getloadavg()[0]
    server, http_port, grpc_port = start_server(args.serve_python, tiny_checkpoint(args.folder), args)
    try:
        http_socket, grpc_socket = triton_sockets(server.pid)
        data = infer_request(image)
        routes = {("HTTP", "front"): http_route(("127.0.0.1", http_port), data),
                  ("HTTP", "socket"): http_route(http_socket, data),
                  ("gRPC", "front"): grpc_route(f"127.0.0.1:{grpc_port}", image),
                  ("gRPC", "socket"): grpc_route(grpc_socket, image)}
        for route in routes.values():  # warm-up
            run_clients(*route, 8, 64)
        speed: dict[tuple[str, int, str], list[float]] = {}
        latency: dict[tuple[str, int, str], list[float]] = {}
        ready: dict[str, list[float]] = {"front": [], "socket": []}
        for r in range(args.rounds):
            for protocol in ("HTTP", "gRPC"):
                for clients in args.clients:
                    order = ["front", "socket"] if (r + clients) % 2 == 0 else ["socket", "front"]
                    for where in order:
                        per_s, ms = run_clients(*routes[(protocol, where)], clients, args.requests)
                        speed.setdefault((protocol, clients, where), []).append(per_s)
                        latency.setdefault((protocol, clients, where), []).extend(ms)
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
            p = {w: np.percentile(latency[(protocol, clients, w)], [50, 99]).tolist() for w in ("front", "socket")}
            rows.append({"protocol": protocol, "clients": clients, "front_per_s": statistics.median(front),
                         "socket_per_s": statistics.median(sock), "ratio": statistics.median(ratios),
                         "ratio_min_max": [min(ratios), max(ratios)], "front_p50_p99_ms": p["front"],
                         "socket_p50_p99_ms": p["socket"], "p99_ratio": p["front"][1] / p["socket"][1]})
    readiness_row = {w: statistics.median(v) for w, v in ready.items()}
    results.save(args.json or results.default_path("bench_serve_front"), environment("cpu"), {
        "model": "tiny se_resnext101_32x4d (1/8 width), engine torch", "image": "256x256 JPEG",
        "requests": args.requests, "rounds": args.rounds, "target_ratio": FRONT_TARGET,
        "load_average": [load_before, os.getloadavg()[0]], "rows": rows,
        "readiness_per_s": readiness_row, "readiness_clients": 8})
    for row in rows:
        print(row)
    print("readiness req/s", readiness_row)
    return 0


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.array(values), q))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="se_resnext101_32x4d")
    parser.add_argument("--engine", default="auto")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--max-queue-delay-ms", type=float, default=5.0)
    parser.add_argument("--front", action="store_true", help="what the front costs (see above)")
    parser.add_argument("--clients", type=int, nargs="+", default=None, help="default 1 8 32; with --front 1 8 64")
    parser.add_argument("--requests", type=int, default=None,
                        help="images per measurement (default 64; with --front, requests: 400)")
    parser.add_argument("--seconds", type=float, default=3.0, help="--front: seconds per readiness measurement")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median reported)")
    parser.add_argument("--folder", type=Path, default=Path("/tmp/convnets_bench_serve"),
                        help="where the JPEGs and the random-weights checkpoint are kept")
    parser.add_argument("--serve-python", default=sys.executable,
                        help="the interpreter that runs `convnets serve` (one with the serve extra; default: this one)")
    results.add_output_option(parser, None, default_help="benchmarks/results/bench_serve.json; with --front "
                                                         "bench_serve_front.json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.front:
        args.clients, args.requests = args.clients or [1, 8, 64], args.requests or 400
        return front_main(args)
    args.clients, args.requests = args.clients or [1, 8, 32], args.requests or 64
    args.json = args.json or results.default_path("bench_serve")

    paths = make_images(args.folder / "images", 32)
    files = [paths[i % len(paths)] for i in range(args.requests)]
    images = [p.read_bytes() for p in files]
    checkpoint = make_checkpoint(args.folder, args.model)
    load_before = os.getloadavg()[0]
    server, port, _ = start_server(args.serve_python, checkpoint, args)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/models/bench/config", timeout=30) as response:
            engine = json.load(response)["parameters"]["engine"]["string_value"]
        model = load_model(checkpoint)
        net = optimize_for_inference(model, args.precision, engine=engine, compile=False)
        labels, preset = class_labels(model), preset_for_model(model)

        def in_process() -> float:
            start = time.perf_counter()
            for result in predict(net, [str(f) for f in files], labels=labels, preset=preset,
                                  batch_size=args.max_batch_size, workers=0):
                assert result.ok, result.error
            return len(files) / (time.perf_counter() - start)

        variants = ["in process", *(f"{c} clients" for c in args.clients)]
        log.info("warm-up (engine %s)", engine)
        in_process()
        served_run(port, images[:args.max_batch_size], args.max_batch_size)
        speed: dict[str, list[float]] = {v: [] for v in variants}
        latency: dict[str, list[float]] = {v: [] for v in variants}
        batch: dict[str, list[float]] = {v: [] for v in variants}
        for r in range(args.rounds):
            shift = r % len(variants)
            for variant in variants[shift:] + variants[:shift]:
                if variant == "in process":
                    speed[variant].append(in_process())
                    continue
                img_s, ms, mean_batch = served_run(port, images, int(variant.split()[0]))
                speed[variant].append(img_s)
                latency[variant] += ms
                batch[variant].append(mean_batch)
            log.info("round %d/%d: %s", r + 1, args.rounds, ", ".join(f"{v} {s[-1]:.2f} img/s" for v, s in speed.items()))
    finally:
        server.send_signal(2)
        server.wait(timeout=120)
    load_after = os.getloadavg()[0]
    base = speed["in process"]
    rows = []
    for variant in variants:
        ratios = [s / b for s, b in zip(speed[variant], base)]
        rows.append({"variant": variant, "img_per_s": statistics.median(speed[variant]),
                     "img_per_s_all_rounds": speed[variant], "vs_in_process": statistics.median(ratios),
                     "vs_in_process_min_max": [min(ratios), max(ratios)],
                     "p50_ms": percentile(latency[variant], 50) if latency[variant] else None,
                     "p99_ms": percentile(latency[variant], 99) if latency[variant] else None,
                     "mean_batch": statistics.mean(batch[variant]) if batch[variant] else None})
    concurrent = [row for row in rows if row["variant"] != "in process" and int(row["variant"].split()[0]) >= 8]
    results.save(args.json, environment("cpu"), {
        "model": args.model, "engine": engine, "precision": args.precision, "requests": args.requests,
        "image": "500x375 JPEG", "max_batch_size": args.max_batch_size, "queue_delay_ms": args.max_queue_delay_ms,
        "rounds": args.rounds, "target_ratio": TARGET_RATIO,
        "worst_ratio_from_8_clients": min((row["vs_in_process"] for row in concurrent), default=None),
        "load_average": [load_before, load_after], "rows": rows})
    for row in rows:
        print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
