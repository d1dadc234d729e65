"""Publishes the same 1000 tensors to a subscriber in this process for a few seconds and prints
the median time of publish(): a steady load for a profiler, and the quickest way to compare two
builds of the module (run each a few times, alternating).

PYTHONPATH=build/python .venv/bin/python bench/peers/publish_loop.py [--numel N] [--seconds S]
    [--parameters]
"""
import argparse
import os
import statistics
import time

import torch

import tensorbucket


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--numel", type=int, default=256, help="float32 values per tensor")
    parser.add_argument("--seconds", type=float, default=3)
    parser.add_argument("--parameters", action="store_true", help="send nn.Parameters")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tensors = {f"t{i}": torch.full((args.numel,), float(i)) for i in range(1000)}
    if args.parameters:
        tensors = {name: torch.nn.Parameter(t) for name, t in tensors.items()}
    channel = f"tbloop-{os.getpid()}"
    with tensorbucket.Publisher(channel, slots=2) as publisher:
        subscriber = tensorbucket.Subscriber(channel, timeout=5)
        times, version = [], 0
        end = time.monotonic() + args.seconds
        while time.monotonic() < end:
            start = time.perf_counter_ns()
            publisher.publish(tensors, version=version)
            times.append(time.perf_counter_ns() - start)
            subscriber.next(timeout=5).release()
            version += 1
    kind = " nn.Parameter" if args.parameters else ""
    print(f"1000 x {args.numel * 4} B{kind}: publish median {statistics.median(times) / 1000:.1f} us "
          f"over {len(times)} publishes")


if __name__ == "__main__":
    main()
