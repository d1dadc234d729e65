"""Where a Python-level handoff spends its time: publish(), next() and tensors() timed apart,
in one process (no wake-up of another process), steady state, medians over 500 rounds each.
publish() and next() are timed in the first 500 rounds, which make no views: making 1000 views
evicts the caches the next publish() uses. tensors() is timed in the 500 after. One case sends
nn.Parameters, as a trainer publishing its named_parameters() does. Then the first publish()
on a new channel, which creates and allocates the slot's segment. Last, a model's own steps at
either end: state_dict() in the trainer, loading a bucket in the server.

PYTHONPATH=build/python .venv/bin/python bench/peers/python_breakdown.py
"""
import os
import statistics
import time

import torch

import tensorbucket


def median_us(samples):
    return statistics.median(samples) / 1000


def main():
    torch.set_num_threads(1)
    channel = f"tbbreakdown-{os.getpid()}"
    with tensorbucket.Publisher(channel, slots=2) as publisher:
        subscriber = tensorbucket.Subscriber(channel, timeout=5)
        for count, numel, kind in ((1000, 1, ""), (1000, 256, ""), (1000, 256, " nn.Parameter"),
                                   (10, 25600, "")):
            tensors = {f"t{i}": torch.full((numel,), float(i)) for i in range(count)}
            if kind:  # what a trainer's named_parameters() holds
                tensors = {name: torch.nn.Parameter(t) for name, t in tensors.items()}
            publish, take, views = [], [], []
            for version in range(1000):
                start = time.perf_counter_ns()
                publisher.publish(tensors, version=version)
                published = time.perf_counter_ns()
                bucket = subscriber.next(timeout=5)
                taken = time.perf_counter_ns()
                if version < 500:
                    publish.append(published - start)
                    take.append(taken - published)
                else:
                    all_views = bucket.tensors()
                    views.append(time.perf_counter_ns() - taken)
                    del all_views
                bucket.release()
            print(f"{count} x {numel * 4} B{kind}: publish {median_us(publish):.1f} us, next "
                  f"{median_us(take):.1f} us, tensors() {median_us(views):.1f} us")

    # The first two publishes on a new channel each create a slot's segment; the third reuses one.
    tensors = {f"t{i}": torch.full((65536,), float(i)) for i in range(1000)}
    rounds = []
    for attempt in range(5):
        with tensorbucket.Publisher(f"{channel}-new{attempt}", slots=2) as publisher:
            subscriber = tensorbucket.Subscriber(f"{channel}-new{attempt}", timeout=5)
            times = []
            for version in range(3):
                start = time.perf_counter_ns()
                publisher.publish(tensors, version=version)
                times.append(time.perf_counter_ns() - start)
                subscriber.next(timeout=5).release()
            rounds.append(times)
    print("1000 x 256 KiB on a new channel: publish " +
          ", ".join(f"{median_us([r[i] for r in rounds]) / 1000:.1f} ms" for i in range(3)) +
          " (new segment, new segment, reused)")

    with tensorbucket.Publisher(channel, slots=2) as publisher:
        subscriber = tensorbucket.Subscriber(channel, timeout=5)
        # Either end of a model with 1000 parameters of 1 KiB: what a trainer pays to build the
        # dict it publishes, and a server to load a bucket (torch's own load_state_dict is
        # quadratic in the number of modules). Each round receives a new bucket, as a server
        # does every update: a bucket's views, once made, are kept by it.
        model = torch.nn.ModuleList(torch.nn.Linear(16, 16, bias=False) for _ in range(1000))
        sent = model.state_dict()
        weights = model.state_dict(keep_vars=True)
        steps = {"state_dict()": lambda bucket: model.state_dict(),
                 "state_dict(keep_vars=True)": lambda bucket: model.state_dict(keep_vars=True),
                 "load_into(model, bucket)": lambda bucket: tensorbucket.load_into(model, bucket),
                 "load_into(weights, bucket), weights built once":
                     lambda bucket: tensorbucket.load_into(weights, bucket),
                 "model.load_state_dict(bucket)": lambda bucket: model.load_state_dict(bucket)}
        for name, step in steps.items():
            rounds = []
            for version in range(20):
                publisher.publish(sent, version=version)
                with subscriber.next(timeout=5) as bucket:
                    start = time.perf_counter_ns()
                    step(bucket)
                    rounds.append(time.perf_counter_ns() - start)
            print(f"1000 x 1024 B parameters: {name} {median_us(rounds):.0f} us")


if __name__ == "__main__":
    main()
