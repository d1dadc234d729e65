"""Where a device handoff's time goes: phase timings on both sides, then torch profiler tables."""
import multiprocessing as mp, statistics, sys, time
import torch, tensorbucket
from torch.profiler import profile, ProfilerActivity

def med(xs): return statistics.median(xs) if xs else float("nan")

def server(channel, handoffs, queue):
    torch.cuda.set_device(0)
    stream = torch.cuda.current_stream()
    rows = []
    with tensorbucket.Subscriber(channel, timeout=60, device="cuda") as subscriber:
        for _ in range(5):
            bucket = subscriber.next(timeout=60)
            stream.synchronize()
            bucket.release()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiled:
            for _ in range(handoffs):
                bucket = subscriber.next(timeout=60)
                returned = time.monotonic_ns()
                views = bucket.tensors()
                viewed = time.monotonic_ns()
                stream.synchronize()
                usable = time.monotonic_ns()
                start, received = bucket.publish_start_ns, bucket.received_ns
                rows.append((received - start, returned - received, viewed - returned, usable - viewed, usable - start))
                bucket.release()
                del views
    names = ["publish start -> hand-over", "hand-over -> next() returns", "tensors()", "stream wait",
             "publish start -> usable"]
    queue.put("server: " + "; ".join(f"{name} {med([row[i] for row in rows]) / 1000:.1f} us"
                                      for i, name in enumerate(names)))
    queue.put("server profile:\n" + profiled.key_averages().table(sort_by="self_cpu_time_total", row_limit=22))


def trainer(channel, tensors, handoffs, queue):
    torch.cuda.set_device(0)
    calls = []
    with tensorbucket.Publisher(channel, device="cuda:0") as publisher:
        for _ in range(5):
            publisher.publish(tensors, timeout=60)
            time.sleep(0.002)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiled:
            for _ in range(handoffs):
                begun = time.perf_counter_ns()
                publisher.publish(tensors, timeout=60)
                calls.append(time.perf_counter_ns() - begun)
                time.sleep(0.002)  # the server waits in next(), as between steps
        publisher.drain(timeout=60)
    queue.put(f"trainer: publish() call {med(calls) / 1000:.1f} us (fastest {min(calls) / 1000:.1f})")
    queue.put("trainer profile:\n" + profiled.key_averages().table(sort_by="self_cpu_time_total", row_limit=22))


def handoff(label, tensors, handoffs=30):
    context = mp.get_context("spawn")
    queue = context.Queue()
    channel = f"tb-gpu-phases-{len(tensors)}"
    receiver = context.Process(target=server, args=(channel, handoffs, queue))
    receiver.start()
    sender = context.Process(target=trainer, args=(channel, tensors, handoffs, queue))
    sender.start()
    sender.join(120)
    receiver.join(120)
    print(f"==== {label}: trainer exited {sender.exitcode}, server {receiver.exitcode}")
    while not queue.empty():
        print(queue.get())
    sys.stdout.flush()
    return sender.exitcode == 0 and receiver.exitcode == 0


def tiny():
    return {"w": torch.ones(16, device="cuda")}


def small():
    return {f"t{i}": torch.full((1024,), i % 7, dtype=torch.float32, device="cuda") for i in range(1000)}


def main():
    torch.cuda.set_device(0)
    for label, make in [("tiny", tiny), ("1000 x 4 KiB", small)]:
        tensors, calls = make(), []
        with tensorbucket.Publisher(f"tb-gpu-phases-alone-{len(tensors)}", device="cuda:0", min_consumers=0) as publisher:
            for _ in range(40):
                begun = time.perf_counter_ns()
                publisher.publish(tensors, timeout=60)
                calls.append(time.perf_counter_ns() - begun)
        print(f"{label}, no consumer: publish() {med(calls[5:]) / 1000:.1f} us (fastest {min(calls[5:]) / 1000:.1f})")
    sys.stdout.flush()
    ok = [handoff("tiny", tiny()), handoff("1000 x 4 KiB", small())]
    return 0 if all(ok) else 1


if __name__ == "__main__":
    sys.exit(main())
