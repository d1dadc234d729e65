"""How Python users hand weights to another process today, timed like `tbucket bench`, beside
the same handoff through the tensorbucket Python module.

Three peers, each a producer (here) and a consumer process on one host:
- tensorbucket: Publisher.publish of the tensors; in the consumer, Subscriber.next, which hands
  back a verified Bucket: a mapping whose zero-copy views are made on first access. Timed
  twice: "tensorbucket" stops once the Bucket is in hand, "tensorbucket all views" also makes
  all 1000 views (Bucket.tensors()), as the flat_bucket consumer does;
- state_dict: a torch.multiprocessing queue of a state dict (tensors move to shared memory and
  are pickled as file-descriptor handles on every send);
- flat_bucket: one persistent shared flat buffer, the tensors copied into it one by one, and
  the metadata (name, dtype, shape, offset) sent over a torch.multiprocessing queue; the
  consumer rebuilds views over the buffer. "flat_bucket_cat" fills the buffer with one
  torch.cat instead, the fastest way to fill it from Python found here.
And one baseline, "memcpy": a single memcpy of the same bytes between two buffers already
written once, in this process.

Latency is CLOCK_MONOTONIC from the producer starting the send to the consumer holding usable
tensors, one isolated handoff at a time (the consumer acknowledges each with its latency), the
same clock and protocol as `tbucket bench`.

A machine's speed drifts (this 2-core VM's by up to 2x, over seconds to minutes), so timing
one contender after the other would compare them under different conditions. All consumers
start first and stay alive; the contenders then take turns, each tensorbucket figure right
before the peers it is compared with, so all of them sample the same stretch of time. A turn
hands off for --warmup-ms without counting (after an idle spell this VM runs short memory-bound
work 5-10x slower for the first ~1 ms), then counts --per-turn handoffs. Prints one JSON object
per (contender, size): the median of all its counted handoffs, the median of each turn, and the
median of the first handoff of each turn ("cold": what a producer that publishes now and then
pays).

Run with the project's Python (scripts/install-deps makes .venv), and the module meson built:
PYTHONPATH=build/python .venv/bin/python bench/peers/python_peers.py
"""
import argparse
import ctypes
import json
import os
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp


# (count, bytes each); iceoryx2_handoff.py times the same sizes for iceoryx2, in its own venv.
SIZES = {"1000 x 1 KiB": (1000, 1024), "1000 x 256 KiB": (1000, 256 << 10), "1 x 256 MiB": (1, 256 << 20)}

# A consumer that died never acknowledges: fail the run instead of waiting forever.
ACK_TIMEOUT_S = 60


def make_tensors(count, tensor_bytes):
    return {f"t{i}": torch.full((tensor_bytes // 4,), float(i), dtype=torch.float32) for i in range(count)}


def state_dict_consumer(queue, acks):
    while (sent := queue.get()) is not None:
        start_ns, state = sent
        assert len(state) > 0
        latency = (time.monotonic_ns() - start_ns) / 1000
        del state, sent
        acks.put(latency)


def flat_bucket_consumer(buffer, queue, acks):
    while (sent := queue.get()) is not None:
        start_ns, metadata = sent
        views = {name: buffer[offset:offset + numel].view(shape)
                 for name, (offset, numel, shape) in metadata.items()}
        assert len(views) > 0
        latency = (time.monotonic_ns() - start_ns) / 1000
        del views
        acks.put(latency)


def tensorbucket_consumer(channel, all_views, acks):
    import tensorbucket
    subscriber = tensorbucket.Subscriber(channel, timeout=30)
    while True:
        try:
            bucket = subscriber.next(timeout=30)
        except tensorbucket.ProducerGone:  # closed after the last bucket
            return
        views = bucket.tensors() if all_views else bucket
        assert len(views) > 0
        # The producer put its start time in the bucket's version.
        latency = (time.monotonic_ns() - bucket.version) / 1000
        del views
        bucket.release()
        acks.put(latency)


class QueuePeer:
    """A torch.multiprocessing queue to a consumer process, which acknowledges each handoff
    with its latency; None stops it."""

    def __init__(self, consumer, *args):
        self.queue, self.acks = mp.Queue(), mp.Queue()
        self.consumer = mp.Process(target=consumer, args=(*args, self.queue, self.acks))
        self.consumer.start()

    def close(self):
        self.queue.put(None)
        self.consumer.join()


class StateDictPeer(QueuePeer):
    def __init__(self, tensors):
        super().__init__(state_dict_consumer)
        self.tensors = tensors

    def handoff(self):
        # A fresh state dict each step, as a trainer sends its current parameters.
        self.queue.put((time.monotonic_ns(), {name: t.clone() for name, t in self.tensors.items()}))
        return self.acks.get(timeout=ACK_TIMEOUT_S)


class FlatBucketPeer(QueuePeer):
    def __init__(self, tensors, one_cat=False):
        buffer = torch.empty(sum(t.numel() for t in tensors.values()), dtype=torch.float32).share_memory_()
        super().__init__(flat_bucket_consumer, buffer)
        self.tensors, self.buffer, self.one_cat = tensors, buffer, one_cat

    def handoff(self):
        start_ns = time.monotonic_ns()
        if self.one_cat:
            torch.cat([t.view(-1) for t in self.tensors.values()], out=self.buffer)
        metadata, offset = {}, 0
        for name, t in self.tensors.items():
            if not self.one_cat:
                self.buffer[offset:offset + t.numel()].copy_(t.view(-1))
            metadata[name] = (offset, t.numel(), tuple(t.shape))
            offset += t.numel()
        self.queue.put((start_ns, metadata))
        return self.acks.get(timeout=ACK_TIMEOUT_S)


class TensorbucketPeer:
    def __init__(self, tensors, all_views):
        import tensorbucket
        self.tensors = tensors
        channel = f"tbpeer-{os.getpid()}-{int(all_views)}-{id(tensors)}"
        self.publisher = tensorbucket.Publisher(channel, slots=2)
        self.acks = mp.Queue()
        self.consumer = mp.Process(target=tensorbucket_consumer, args=(channel, all_views, self.acks))
        self.consumer.start()

    def handoff(self):
        self.publisher.publish(self.tensors, version=time.monotonic_ns(), timeout=30)
        return self.acks.get(timeout=ACK_TIMEOUT_S)

    def close(self):
        self.publisher.close()
        self.consumer.join()


class Memcpy:
    """One memcpy of all the tensors' bytes, between two buffers written once before."""

    def __init__(self, tensors):
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        self.source = torch.ones(size, dtype=torch.uint8)
        self.destination = torch.zeros(size, dtype=torch.uint8)

    def handoff(self):
        start_ns = time.monotonic_ns()
        ctypes.memmove(self.destination.data_ptr(), self.source.data_ptr(), self.source.numel())
        return (time.monotonic_ns() - start_ns) / 1000

    def close(self):
        pass


def contenders(has_tensorbucket):
    """In turn order: each tensorbucket figure right before the peers it is compared with."""
    out = [("flat_bucket", FlatBucketPeer), ("flat_bucket_cat", lambda t: FlatBucketPeer(t, one_cat=True)),
           ("memcpy", Memcpy), ("state_dict", StateDictPeer)]
    if has_tensorbucket:
        out.insert(0, ("tensorbucket", lambda t: TensorbucketPeer(t, all_views=False)))
        out.insert(3, ("tensorbucket all views", lambda t: TensorbucketPeer(t, all_views=True)))
    return out


def take_turn(contender, warmup_s, counted):
    """One turn: handoffs until warmup_s has passed (at least one), then `counted` more.
    Returns the first latency (the cold one) and the counted ones."""
    end = time.monotonic() + warmup_s
    cold = contender.handoff()
    while time.monotonic() < end:
        contender.handoff()
    return cold, [contender.handoff() for _ in range(counted)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--turns", type=int, default=5, help="turns each contender takes")
    parser.add_argument("--per-turn", type=int, default=8, help="counted handoffs per turn (small case)")
    parser.add_argument("--warmup-ms", type=float, default=50, help="uncounted handoffs first, each turn")
    parser.add_argument("--size", choices=list(SIZES), action="append",
                        help="tensors of a size (repeatable; default: 1000 x 1 KiB and 1000 x 256 KiB)")
    args = parser.parse_args()
    mp.set_start_method("spawn")
    torch.set_num_threads(1)
    try:
        import tensorbucket  # noqa: F401  (built by meson; on PYTHONPATH)
        has_tensorbucket = True
    except ImportError:
        print("tensorbucket module not importable: set PYTHONPATH to build/python", file=sys.stderr)
        has_tensorbucket = False
    for label in args.size or ["1000 x 1 KiB", "1000 x 256 KiB"]:
        count, tensor_bytes = SIZES[label]
        per_turn = args.per_turn if count * tensor_bytes <= (1 << 20) else max(2, args.per_turn // 4)
        tensors = make_tensors(count, tensor_bytes)
        running = [(name, make(tensors)) for name, make in contenders(has_tensorbucket)]
        for _, contender in running:
            contender.handoff()  # returns once its consumer is up: no turn competes with a start-up
        colds, turns = {name: [] for name, _ in running}, {name: [] for name, _ in running}
        for _ in range(args.turns):
            for name, contender in running:
                cold, counted = take_turn(contender, args.warmup_ms / 1000, per_turn)
                colds[name].append(cold)
                turns[name].append(counted)
        for _, contender in running:
            contender.close()
        for name, samples in turns.items():
            print(json.dumps({"peer": name, "size": label,
                              "median_us": statistics.median(x for turn in samples for x in turn),
                              "turn_medians_us": [statistics.median(turn) for turn in samples],
                              "cold_median_us": statistics.median(colds[name]),
                              "per_turn": per_turn, "turns": args.turns}), flush=True)


if __name__ == "__main__":
    main()
