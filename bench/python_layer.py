"""What the package's Python layer (argument checks, the Bucket wrapper) adds to a small
handoff, against the same calls straight into its bindings (tensorbucket._C), in one run.

  PYTHONPATH=build/python .venv/bin/python bench/python_layer.py [--tensors N]

One round: publish N tensors of 16 float32, next(), one view, release(). Medians of 7 runs of
2000 rounds each, the two ways interleaved so that the machine's noise falls on both.
"""
import argparse
import os
import statistics
import time

import torch

import tensorbucket


def microseconds_per_round(round_trip, rounds=2000):
    start = time.perf_counter_ns()
    for _ in range(rounds):
        round_trip()
    return (time.perf_counter_ns() - start) / rounds / 1000


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=10)
    tensors = {f"w{i}": torch.ones(16) for i in range(parser.parse_args().tensors)}
    channel = f"tbpylayer-{os.getpid()}"
    with tensorbucket.Publisher(channel, min_consumers=0) as publisher, \
            tensorbucket.Subscriber(channel) as subscriber:
        def through_the_package():
            publisher.publish(tensors, timeout=5)
            bucket = subscriber.next(timeout=5)
            bucket["w0"]
            bucket.release()

        def through_the_bindings():
            publisher._impl.publish(tensors, 0, 0, 1, None, 5.0)
            bucket = subscriber._impl.next(5.0, None)
            bucket["w0"]
            bucket.release()

        package, bindings = [], []
        for _ in range(7):
            package.append(microseconds_per_round(through_the_package))
            bindings.append(microseconds_per_round(through_the_bindings))
    package, bindings = statistics.median(package), statistics.median(bindings)
    print(f"{len(tensors)} tensors: package {package:.2f} us, bindings {bindings:.2f} us per round; "
          f"the Python layer adds {package - bindings:.2f} us ({package / bindings:.2f}x)")
    print(f"load average {os.getloadavg()[0]:.2f} (2 cores here: above ~0.5 the machine was not quiet)")


if __name__ == "__main__":
    main()
