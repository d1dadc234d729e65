"""Eclipse iceoryx2 from PyPI (0.10), the same Python handoff that python_peers.py times for
tensorbucket: N tensors in private memory on one side, N usable views on the other.

iceoryx2 needs neither torch nor this project's module, and pins its own dependencies, so it
runs in a venv of its own:

    python3 -m venv .venv-iceoryx2 && .venv-iceoryx2/bin/pip install 'iceoryx2==0.10.*' numpy
    .venv-iceoryx2/bin/python bench/peers/iceoryx2_handoff.py [--rounds 7] [--per-round 200]

The tensorbucket side of the comparison is python_peers.py ("tensorbucket all views"), run right
before and after this in the same sitting (bench/RESULTS.md has both, with the commands).

- Producer (here): loans a slice of the bucket's bytes (`loan_slice_uninit`), fills it from the
  N arrays with one `numpy.concatenate(..., out=...)` (the tensors back to back: the fastest
  fill found from Python; 1 KiB tensors stay 256-byte aligned), sends it.
- Consumer (a child process): spins on `receive()` (no wake-up to pay: kinder to iceoryx2 than
  tensorbucket's blocking next()), makes the N numpy views over the sample, and writes its
  latency to a pipe, which the producer reads before the next handoff.

Latency: CLOCK_MONOTONIC from the producer's loan to the consumer holding all views. Each round
hands off --warmup-ms without counting, then --per-round times; prints one JSON line per size
with the median of all counted handoffs and of each round.
"""
import argparse
import ctypes
import importlib.metadata
import json
import os
import statistics
import struct
import time

import iceoryx2 as iox2
import numpy as np

SIZES = {"1000 x 1 KiB": (1000, 1024), "1 x 256 MiB": (1, 256 << 20)}


def service(node, name, total):
    return (node.service_builder(iox2.ServiceName.new(name))
            .publish_subscribe(iox2.Slice[ctypes.c_uint8])
            .open_or_create())


def as_array(ptr, total):
    return np.ctypeslib.as_array((ctypes.c_uint8 * total).from_address(ptr))


def consumer(name, count, tensor_bytes, acks):
    total = count * tensor_bytes
    node = iox2.NodeBuilder.new().create(iox2.ServiceType.Ipc)
    subscriber = service(node, name, total).subscriber_builder().create()
    os.write(acks, struct.pack("d", -1.0))  # subscribed
    while True:
        sample = subscriber.receive()
        if sample is None:
            continue
        start_ns = struct.unpack_from("q", bytes(as_array(sample.payload().as_ptr(), 8)))[0]
        if start_ns == 0:
            return
        payload = as_array(sample.payload().as_ptr() + 64, total).view(np.float32)
        per = tensor_bytes // 4
        views = [payload[i * per:(i + 1) * per] for i in range(count)]
        latency_us = (time.monotonic_ns() - start_ns) / 1000
        assert views[-1][0] == count - 1
        del views, payload, sample
        os.write(acks, struct.pack("d", latency_us))


def run_size(label, count, tensor_bytes, args):
    name = f"tbbench-iceoryx2-{os.getpid()}-{count}x{tensor_bytes}"
    total = count * tensor_bytes
    sources = [np.full(tensor_bytes // 4, float(i), dtype=np.float32) for i in range(count)]
    node = iox2.NodeBuilder.new().create(iox2.ServiceType.Ipc)
    publisher = (service(node, name, total).publisher_builder()
                 .initial_max_slice_len(64 + total).allocation_strategy(iox2.AllocationStrategy.Static).create())
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(read_end)
        try:
            consumer(name, count, tensor_bytes, write_end)
        finally:
            os._exit(0)
    os.close(write_end)
    assert struct.unpack("d", os.read(read_end, 8))[0] == -1.0

    def handoff():
        start_ns = time.monotonic_ns()
        sample = publisher.loan_slice_uninit(64 + total)
        ptr = sample.payload().as_ptr()
        np.concatenate(sources, out=as_array(ptr + 64, total).view(np.float32))
        ctypes.memmove(ptr, struct.pack("q", start_ns), 8)
        sample.assume_init().send()
        return struct.unpack("d", os.read(read_end, 8))[0]

    rounds = []
    for _ in range(args.rounds):
        until = time.monotonic() + args.warmup_ms / 1000
        while time.monotonic() < until:
            handoff()
        rounds.append([handoff() for _ in range(args.per_round if count > 1 else max(5, args.per_round // 20))])
    sample = publisher.loan_slice_uninit(64 + total)
    ctypes.memmove(sample.payload().as_ptr(), struct.pack("q", 0), 8)
    sample.assume_init().send()
    os.waitpid(child, 0)
    every = [latency for turn in rounds for latency in turn]
    print(json.dumps({"contender": "iceoryx2", "size": label, "median_us": round(statistics.median(every), 1),
                      "round_medians_us": [round(statistics.median(turn), 1) for turn in rounds],
                      "iceoryx2": importlib.metadata.version("iceoryx2")}), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--per-round", type=int, default=200)
    parser.add_argument("--warmup-ms", type=int, default=200)
    parser.add_argument("--size", choices=list(SIZES), action="append")
    args = parser.parse_args()
    for label in args.size or SIZES:
        run_size(label, *SIZES[label], args)


if __name__ == "__main__":
    main()
