"""Micro-benchmark: KV bandwidth over a TorchDist (gloo) pair vs a raw TCP socket, two processes.

    python bench/studies/kv_bandwidth.py --out kv_bw.json [--sizes-mb 8 32 128 256]

Each size is one transfer of 4 layer messages (size/4 bytes each) over loopback; the socket
baseline copies the same bytes with sendall/recv_into. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import time

import torch

from kv_transfer import KVLayout, KVTransferSpec, TorchDistReceiver, TorchDistSender

NUM_LAYERS, HEADS, HEAD_DIM = 4, 8, 64


def _spec(i: int, size_mb: int, layout: KVLayout) -> KVTransferSpec:
    per_layer = size_mb * 2**20 // NUM_LAYERS
    tokens = per_layer // (2 * HEADS * HEAD_DIM * 4)
    return KVTransferSpec(f"bench-{i}", i, tokens, layout)


def _gloo_sender(addr, layout, sizes, reps) -> None:
    tx = TorchDistSender("bench-prefill", layout, timeout_s=60)
    i = 0
    for size in sizes:
        for _ in range(reps + 1):
            spec = _spec(i, size, layout)
            kvs = [torch.ones(spec.layer_shape) for _ in range(NUM_LAYERS)]
            for layer, kv in enumerate(kvs):
                tx.send_layer(addr, spec, layer, kv)
            tx.finish(spec, 60)
            i += 1
    tx.close()


def bench_gloo(sizes: list[int], reps: int) -> dict[int, float]:
    """GB/s per size: the mean over ``reps`` back-to-back transfers after one warm-up.

    Every transfer is expected before the sender starts: as in the cluster, where the spec
    comes from the receiver, a receiver expects a transfer before its first layer is sent
    (one it does not expect is read and dropped)."""
    layout = KVLayout("bench", "float32", NUM_LAYERS, HEADS, HEAD_DIM)
    rx = TorchDistReceiver("bench-decode", layout, timeout_s=60)
    plan = [[_spec(i * (reps + 1) + r, size, layout) for r in range(reps + 1)]
            for i, size in enumerate(sizes)]
    for specs in plan:
        for spec in specs:
            rx.expect(spec, "bench-prefill", lambda *_: None)
    p = mp.get_context("spawn").Process(target=_gloo_sender, args=(rx.address, layout, sizes, reps))
    p.start()
    out = {}
    for size, specs in zip(sizes, plan, strict=True):
        rx.wait(specs[0].request_id, 60)  # the warm-up (the first one also builds the group)
        t0 = time.perf_counter()
        for spec in specs[1:]:
            rx.wait(spec.request_id, 60)
        out[size] = size * 2**20 * reps / (time.perf_counter() - t0) / 1e9
    p.join(60)
    rx.close()
    return out


def _socket_sender(port, sizes, reps) -> None:
    with socket.create_connection(("127.0.0.1", port)) as s:
        for size in sizes:
            buf = bytearray(size * 2**20)
            for _ in range(reps + 1):
                s.recv(1)  # go signal
                s.sendall(buf)


def bench_socket(sizes: list[int], reps: int) -> dict[int, float]:
    srv = socket.create_server(("127.0.0.1", 0))
    p = mp.get_context("spawn").Process(target=_socket_sender,
                                        args=(srv.getsockname()[1], sizes, reps))
    p.start()
    conn, _ = srv.accept()
    out = {}
    with conn:
        for size in sizes:
            buf = memoryview(bytearray(size * 2**20))
            times = []
            for rep in range(reps + 1):
                t0 = time.perf_counter()
                conn.sendall(b"g")
                got = 0
                while got < len(buf):
                    got += conn.recv_into(buf[got:])
                if rep:
                    times.append(time.perf_counter() - t0)
            out[size] = size * 2**20 / min(times) / 1e9
    p.join(60)
    srv.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True, help="path of the JSON result")
    ap.add_argument("--sizes-mb", type=int, nargs="+", default=[8, 32, 128, 256])
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    gloo, sock = bench_gloo(args.sizes_mb, args.reps), bench_socket(args.sizes_mb, args.reps)
    print(f"{'size_mb':>8} {'gloo_GB/s':>10} {'socket_GB/s':>12} {'ratio':>6}")
    rows = []
    for size in args.sizes_mb:
        rows.append({"size_mb": size, "gloo_gb_s": gloo[size], "socket_gb_s": sock[size]})
        print(f"{size:>8} {gloo[size]:>10.2f} {sock[size]:>12.2f} {gloo[size] / sock[size]:>6.2f}")
    with open(args.out, "w") as f:
        json.dump({"num_layers": NUM_LAYERS, "reps": args.reps, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
