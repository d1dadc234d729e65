"""tensorbucket across two hosts (serve -> relay), beside ucx_perftest and torch.distributed (gloo).

    scripts/install-deps && scripts/setup-build build && ninja -C build
    sudo .venv/bin/python bench/peers/network_hosts.py [--build build] [--rounds 3]

The hosts are two network namespaces joined by a veth pair (198.18.200.1 and .2, RFC 2544's
benchmarking range, on those veths only), made here and removed at the end; UCX is held to its
TCP transport (UCX_TLS=tcp), as between two machines without RDMA. In each round, in the same
run:
- throughput of 256 MiB buckets: a Python trainer in host a publishes one 256 MiB tensor again
  and again; `tbucket serve` sends it to `tbucket relay` in host b, which republishes it to a
  consumer there. The relay's rate line counts from the first bucket's arrival to the last one's
  publish; 40 buckets, so that the first ones, which fault in fresh slots, weigh little. Also
  the CPU time serve and relay took per bucket (user and system, read from /proc while they
  run). Beside it, `ucx_perftest -t tag_bw -s 256MiB` between the same hosts: the limit. And,
  for context only, ucx_perftest again while the same trainer and consumer run beside it,
  paced at our measured bucket rate: both hosts share this machine's cores, so the trainer's
  copy of each bucket takes CPU time from the transfer, which it would not on two machines.
- latency of buckets of 1000 x 1 KiB tensors: a Python trainer in host a publishes them, a
  Python server in host b takes each from the relay's channel. Two paces: one bucket every
  20 ms (the machine idles between them), and in turns (the next once the server had the last,
  told through a pipe, as a ping-pong goes). Two medians each: from publish() called, Python's
  publish of 1000 tensors (0.3-1 ms) included, and from publish() returned, to the views in
  hand in host b. Beside them, `ucx_perftest -t tag_lat` with one message of the same bytes
  (its one-way latency: half a round trip).
- gloo: torch.distributed.broadcast of the same 256 MiB and 1000 KiB flat tensors, rank 0 in
  host a, rank 1 in host b; the median of rank 1's broadcast times.
It prints the median over the rounds of each figure and the ratios.
"""
import argparse
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

A, B = "tbbench-a", "tbbench-b"
ADDR_A, ADDR_B = "198.18.200.1", "198.18.200.2"
BIG = 256 << 20
SMALL_TENSORS, SMALL_BYTES = 1000, 1024


def ip(*args, check=True):
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def make_hosts():
    remove_hosts()
    ip("netns", "add", A)
    ip("netns", "add", B)
    ip("link", "add", "tbbench-va", "type", "veth", "peer", "name", "tbbench-vb")
    for ns, veth, addr in ((A, "tbbench-va", ADDR_A), (B, "tbbench-vb", ADDR_B)):
        ip("link", "set", veth, "netns", ns)
        ip("-n", ns, "addr", "add", f"{addr}/24", "dev", veth)
        ip("-n", ns, "link", "set", veth, "up")
        ip("-n", ns, "link", "set", "lo", "up")


def remove_hosts():
    ip("netns", "del", A, check=False)
    ip("netns", "del", B, check=False)


def in_host(ns, *command, env=None, **kwargs):
    env = dict(os.environ, UCX_TLS="tcp", **(env or {}))
    return subprocess.Popen(["ip", "netns", "exec", ns, *command], env=env, **kwargs)


def perftest_program():
    """The ucx_perftest of the UCX tbucket is built on, and its environment: the one of PyPI's
    libucx in this Python (net/meson.build), with its libraries, else the system's."""
    try:
        import libucx
    except ImportError:
        return "ucx_perftest", {}
    prefix = pathlib.Path(libucx.__file__).parent
    return str(prefix / "bin" / "ucx_perftest"), {"LD_LIBRARY_PATH": str(prefix / "lib")}


def perftest(test, size, iterations, port):
    """ucx_perftest's Final line as {field: value}: its server in host a, its client in b."""
    program, env = perftest_program()
    server = in_host(A, program, "-p", str(port), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.5)
        client = in_host(B, program, ADDR_A, "-p", str(port), "-t", test, "-s", str(size), "-n",
                         str(iterations), "-w", str(max(2, iterations // 10)), env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
        out, _ = client.communicate(timeout=300)
    finally:
        server.kill()
        server.wait()
    final = [line for line in out.splitlines() if line.startswith("Final:")]
    if not final:
        sys.exit(f"ucx_perftest {test} printed no Final line:\n{out}")
    # Final: iterations, latency 50%ile, average, overall (us), bandwidth average, overall (MB/s), ...
    values = [float(v) for v in final[0].split()[1:]]
    return {"latency_median_us": values[1], "bandwidth_MBps": values[4]}


def stop(tbucket, processes, channels):
    """Stops those of `processes` still running (SIGTERM, then SIGKILL after 10 s), then removes
    what a producer killed there left of `channels` in /dev/shm: slots of 256 MiB, which would
    otherwise pile up in memory round after round."""
    for proc in processes:
        if proc.poll() is None:
            proc.terminate()
    for proc in processes:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for channel in channels:
        subprocess.run([tbucket, "rm", channel], capture_output=True)  # nothing left: it says so


# Publishes COUNT buckets, INTERVAL seconds apart at least (0: as fast as slots come free).
TRAINER = textwrap.dedent("""
    import sys, time, torch, tensorbucket as tb
    channel, count, interval = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    weights = {"flat": torch.ones(%d // 4, dtype=torch.float32)}
    with tb.Publisher(channel) as publisher:
        for version in range(count):
            started = time.monotonic()
            publisher.publish(weights, version=version, timeout=120)
            time.sleep(max(0.0, interval - (time.monotonic() - started)))
""" % BIG)


class CpuTime:
    """The CPU seconds (user and system) processes have taken, read from /proc every 50 ms
    until stop(): the last reading of a process that ended on its own stands."""

    def __init__(self, processes):
        self.processes, self.seconds = processes, {}
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.watch)
        self.thread.start()

    def watch(self):
        while not self.done.wait(0.05):
            for name, process in self.processes.items():
                try:
                    fields = pathlib.Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                if fields[0] != "Z":  # a zombie's times are gone
                    self.seconds[name] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self):
        self.done.set()
        self.thread.join()
        return self.seconds


def ours_throughput(tbucket, token, port, buckets):
    """MB/s from the relay's rate line, and serve's and relay's CPU ms per bucket."""
    up, down = f"bench-up-{port}", f"bench-down-{port}"
    consumer = in_host(B, tbucket, "consume", "--channel", down, "--buckets", str(buckets), "--quiet",
                       "--timeout-ms", "120000", stdout=subprocess.DEVNULL)
    relay = in_host(B, tbucket, "relay", "--connect", f"{ADDR_A}:{port}", "--channel", up, "--as", down,
                    "--token-file", token, "--buckets", str(buckets), "--quiet", stdout=subprocess.PIPE, text=True)
    trainer = in_host(A, sys.executable, "-c", TRAINER, up, str(buckets), "0")
    time.sleep(2)  # the trainer's channel, before serve attaches
    serve = in_host(A, tbucket, "serve", "--channel", up, "--listen", f"{ADDR_A}:{port}", "--token-file", token,
                    stderr=subprocess.DEVNULL)
    cpu = CpuTime({"serve": serve, "relay": relay})
    try:
        out, _ = relay.communicate(timeout=600)
        consumer.wait(timeout=60)
        trainer.wait(timeout=60)
    finally:
        cpu_seconds = cpu.stop()
        stop(tbucket, (serve, relay, trainer, consumer), (up, down))
    rate = re.search(r"([0-9.]+) MiB/s", out)
    if not rate:
        sys.exit(f"the relay printed no rate:\n{out}")
    cpu_ms = {name: seconds * 1000 / buckets for name, seconds in cpu_seconds.items()}
    return float(rate.group(1)) * (1 << 20) / 1e6, cpu_ms["serve"], cpu_ms["relay"]  # MB/s, as ucx_perftest counts


def perftest_beside_trainer(tbucket, port, bucket_seconds):
    """ucx_perftest tag_bw of 256 MiB while the throughput run's trainer and consumer work beside
    it, a bucket every `bucket_seconds` (ours' pace), through a local channel: MB/s."""
    channel = f"bench-beside-{port}"
    consumer = in_host(B, tbucket, "consume", "--channel", channel, "--buckets", "1000000", "--quiet",
                       "--timeout-ms", "120000", stdout=subprocess.DEVNULL)
    trainer = in_host(A, sys.executable, "-c", TRAINER, channel, "1000000", str(bucket_seconds),
                      stdout=subprocess.DEVNULL)
    try:
        time.sleep(4)  # torch imported, buckets flowing
        if trainer.poll() is not None or consumer.poll() is not None:
            sys.exit("the trainer or consumer beside ucx_perftest ended early")
        return perftest("tag_bw", BIG, 20, port)["bandwidth_MBps"]
    finally:
        stop(tbucket, (trainer, consumer), (channel,))


# The trainer's version is CLOCK_MONOTONIC just before publish() (the hosts share the machine's
# clock); it prints when publish() returned. Paced, it publishes every 20 ms; in turns, once the
# server in host b has had the previous bucket (a byte through a pipe, not the network), as
# ucx_perftest's ping-pong sends once the previous message came back.
SMALL_TRAINER = textwrap.dedent('''
    import os, sys, time, torch, tensorbucket as tb
    channel, count, turns = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    tensors = {f"t{i}": torch.zeros(%d // 4, dtype=torch.float32) for i in range(%d)}
    with tb.Publisher(channel) as publisher:
        for _ in range(count):
            version = time.monotonic_ns()
            publisher.publish(tensors, version=version, timeout=120)
            print(version, time.monotonic_ns(), flush=True)
            if turns >= 0:
                os.read(turns, 1)
            else:
                time.sleep(0.02)
''' % (SMALL_BYTES, SMALL_TENSORS))

SMALL_SERVER = textwrap.dedent('''
    import os, sys, time, tensorbucket as tb
    channel, count, turns = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    subscriber = tb.Subscriber(channel, timeout=120)
    for _ in range(count):
        bucket = subscriber.next(timeout=120)
        print(bucket.version, time.monotonic_ns(), flush=True)
        bucket.release()
        if turns >= 0:
            os.write(turns, b"x")
''')


def ours_latency(tbucket, token, port, buckets, in_turns):
    """Medians, in µs, of publish() called -> views in host b, and publish() returned -> views."""
    up, down = f"bench-lat-up-{port}", f"bench-lat-down-{port}"
    take_turn, give_turn = os.pipe() if in_turns else (-1, -1)
    relay = in_host(B, tbucket, "relay", "--connect", f"{ADDR_A}:{port}", "--channel", up, "--as", down,
                    "--token-file", token, "--buckets", str(buckets), "--quiet", stdout=subprocess.DEVNULL)
    consumer = in_host(B, sys.executable, "-c", SMALL_SERVER, down, str(buckets), str(give_turn),
                       stdout=subprocess.PIPE, text=True, pass_fds=[give_turn] if in_turns else [])
    trainer = in_host(A, sys.executable, "-c", SMALL_TRAINER, up, str(buckets), str(take_turn),
                      stdout=subprocess.PIPE, text=True, pass_fds=[take_turn] if in_turns else [])
    time.sleep(2)
    serve = in_host(A, tbucket, "serve", "--channel", up, "--listen", f"{ADDR_A}:{port}", "--token-file", token,
                    stderr=subprocess.DEVNULL)
    try:
        out, _ = consumer.communicate(timeout=600)
        published, _ = trainer.communicate(timeout=60)
    finally:
        stop(tbucket, (serve, relay, trainer, consumer), (up, down))
        if in_turns:
            os.close(take_turn)
            os.close(give_turn)
    returned = dict(tuple(map(int, line.split())) for line in published.splitlines())
    arrived = [tuple(map(int, line.split())) for line in out.splitlines()][buckets // 10:]  # past the first tenth: warm
    return (statistics.median((views - version) / 1000 for version, views in arrived),
            statistics.median((views - returned[version]) / 1000 for version, views in arrived))


GLOO = textwrap.dedent("""
    import os, statistics, sys, time, torch, torch.distributed as dist
    rank, size, repeats = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    dist.init_process_group("gloo", init_method="tcp://%s:29517", rank=rank, world_size=2)
    flat = torch.ones(size // 4, dtype=torch.float32)
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        dist.broadcast(flat, src=0)
        times.append(time.perf_counter() - start)
    if rank == 1:
        print(statistics.median(times[1:]) * 1e6)
    dist.destroy_process_group()
""" % ADDR_A)


def gloo_broadcast_us(size, repeats):
    sender = in_host(A, "env", f"GLOO_SOCKET_IFNAME=tbbench-va", sys.executable, "-c", GLOO, "0", str(size), str(repeats))
    receiver = in_host(B, "env", f"GLOO_SOCKET_IFNAME=tbbench-vb", sys.executable, "-c", GLOO, "1", str(size),
                       str(repeats), stdout=subprocess.PIPE, text=True)
    out, _ = receiver.communicate(timeout=600)
    sender.wait(timeout=60)
    return float(out.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", default="build")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--buckets", type=int, default=40, help="256 MiB buckets per throughput round")
    parser.add_argument("--small-buckets", type=int, default=300, help="1000 x 1 KiB buckets per latency round")
    parser.add_argument("--what", choices=("all", "throughput", "latency"), default="all",
                        help="both halves, or only one (the other's figures are left out)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("network_hosts.py makes network namespaces: run it as root")
    tbucket = str(pathlib.Path(args.build, "tools", "tbucket").resolve())
    rows = {key: [] for key in ("ours_MBps", "serve_cpu_ms", "relay_cpu_ms", "perftest_MBps", "perftest_beside_MBps",
                                "gloo_big_us",
                                "ours_lat_us", "ours_lat_published_us", "ours_turns_us", "ours_turns_published_us",
                                "perftest_lat_us", "gloo_small_us")}
    with tempfile.TemporaryDirectory() as tmp:
        token = pathlib.Path(tmp, "token")
        token.write_bytes(os.urandom(24).hex().encode())
        token.chmod(0o600)
        make_hosts()
        try:
            for round_ in range(args.rounds):
                port = 17100 + round_ * 10
                if args.what in ("all", "throughput"):
                    rows["perftest_MBps"].append(perftest("tag_bw", BIG, 20, port)["bandwidth_MBps"])
                    for key, value in zip(("ours_MBps", "serve_cpu_ms", "relay_cpu_ms"),
                                          ours_throughput(tbucket, str(token), port + 1, args.buckets)):
                        rows[key].append(value)
                    rows["perftest_beside_MBps"].append(
                        perftest_beside_trainer(tbucket, port + 5, BIG / (rows["ours_MBps"][-1] * 1e6)))
                    rows["gloo_big_us"].append(gloo_broadcast_us(BIG, 12))
                if args.what in ("all", "latency"):
                    rows["perftest_lat_us"].append(
                        perftest("tag_lat", SMALL_TENSORS * SMALL_BYTES, 200, port + 2)["latency_median_us"])
                    paced = ours_latency(tbucket, str(token), port + 3, args.small_buckets, in_turns=False)
                    turns = ours_latency(tbucket, str(token), port + 4, args.small_buckets, in_turns=True)
                    rows["ours_lat_us"].append(paced[0])
                    rows["ours_lat_published_us"].append(paced[1])
                    rows["ours_turns_us"].append(turns[0])
                    rows["ours_turns_published_us"].append(turns[1])
                    rows["gloo_small_us"].append(gloo_broadcast_us(SMALL_TENSORS * SMALL_BYTES, 200))
                print(f"round {round_ + 1}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in rows.items() if v), flush=True)
        finally:
            remove_hosts()
    med = {key: statistics.median(values) for key, values in rows.items() if values}
    print(f"\nmedians of {args.rounds} rounds (load average {os.getloadavg()[0]:.2f}):")
    if "ours_MBps" in med:
        gloo_MBps = BIG / med["gloo_big_us"]
        print(f"256 MiB buckets: ours {med['ours_MBps']:.0f} MB/s, ucx_perftest tag_bw {med['perftest_MBps']:.0f} MB/s "
              f"({med['ours_MBps'] / med['perftest_MBps']:.0%} of it), gloo broadcast {gloo_MBps:.0f} MB/s")
        print(f"  CPU per bucket: serve {med['serve_cpu_ms']:.0f} ms, relay {med['relay_cpu_ms']:.0f} ms")
        print(f"  context: ucx_perftest tag_bw with the same trainer and consumer beside it, at ours' bucket rate: "
              f"{med['perftest_beside_MBps']:.0f} MB/s (ours {med['ours_MBps'] / med['perftest_beside_MBps']:.0%} of it)")
    if "ours_lat_us" in med:
        ping = med["perftest_lat_us"]
        print(f"1000 x 1 KiB: ucx_perftest tag_lat {ping:.0f} us one way, gloo broadcast {med['gloo_small_us']:.0f} us; "
              "ours, publish() called -> views on the other host (publish() returned -> views):")
        for label, key in (("every 20 ms", "ours_lat"), ("in turns", "ours_turns")):
            print(f"  {label}: {med[key + '_us']:.0f} us ({med[key + '_us'] / ping:.2f}x) "
                  f"({med[key + '_published_us']:.0f} us, {med[key + '_published_us'] / ping:.2f}x)")

if __name__ == "__main__":
    main()
