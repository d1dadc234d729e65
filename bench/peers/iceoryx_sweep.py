"""tensorbucket beside Eclipse iceoryx and memcpy, from 1 MiB to 1 GiB (1000 tensors a bucket).

    scripts/install-deps --peers          # Debian's iceoryx
    scripts/setup-build build && ninja -C build   # (re)configured, the peer builds
    .venv/bin/python bench/peers/iceoryx_sweep.py [--build build] [--rounds 3] [--plot bench/iceoryx_sweep.png]

Starts its own RouDi (iceoryx's daemon) with a private config whose mempools fit the sweep's
chunks (4.3 GB of /dev/shm, besides tbucket's two 1 GiB slots), and stops it at the end,
whatever happens. At every size it runs, in turns (the order
alternating from round to round), `tbucket bench --json --tensor-bytes N` (our copy handoff and
in-place commit, and a memcpy of the same bytes) and `iceoryx_handoff N` (iceoryx's loan + fill
+ publish -> take and publish -> take, and its own memcpy). Both consumers poll. It prints the
median over the rounds of each figure, the ratios, and saves a plot (matplotlib).
"""
import argparse
import getpass
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

TENSOR_BYTES = [1 << 10, 4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20]  # x 1000 tensors
TENSORS = 1000
MEMPOOL_SLACK = 4096  # iceoryx's chunk header and the 256-byte alignment of the payload


def size_text(n):
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def bucket_text(tensor_bytes):
    return f"{TENSORS} x {size_text(tensor_bytes)} ({TENSORS * tensor_bytes / (1 << 20):.0f} MiB)"


def roudi_config(path):
    """One mempool per bucket size: the chunk being filled, the one the subscriber holds, a spare."""
    pools = "".join(f"[[segment.mempool]]\nsize = {TENSORS * n + MEMPOOL_SLACK}\ncount = {3 if n >= 256 << 10 else 4}\n\n"
                    for n in TENSOR_BYTES)
    path.write_text(f"[general]\nversion = 1\n\n[[segment]]\n\n{pools}")


def start_roudi(config, log):
    """RouDi's output goes to a file: a pipe nobody reads would fill with its warnings and stall it."""
    with open(log, "w") as out:
        roudi = subprocess.Popen(["iox-roudi", "-c", str(config), "-l", "warning", "-k", "1"], stdout=out,
                                 stderr=subprocess.STDOUT)
    time.sleep(1.0)  # it maps its segments first; a runtime that comes early waits for it anyway
    if roudi.poll() is not None:
        sys.exit(f"iox-roudi exited at once (another RouDi running?):\n{pathlib.Path(log).read_text()}")
    return roudi


def stop_roudi(roudi):
    """Stops RouDi (~15 s here). One that did not end cleanly (it aborts once an application of
    its crashed) leaves its shared memory and sockets behind: ours, as it started, so removed."""
    roudi.send_signal(signal.SIGINT)
    try:
        roudi.wait(timeout=60)
    except subprocess.TimeoutExpired:
        roudi.kill()
        roudi.wait()
    if roudi.returncode != 0:
        left = [pathlib.Path(p) for p in ("/dev/shm/iceoryx_mgmt", f"/dev/shm/{getpass.getuser()}", "/tmp/roudi",
                                          "/tmp/roudi.lock", "/tmp/iox-unique-roudi.lock")]
        removed = [str(p) for p in left if p.exists()]
        for path in left:
            path.unlink(missing_ok=True)
        print(f"RouDi ended with status {roudi.returncode}; removed what it left: {', '.join(removed) or 'nothing'}")


def median(values):
    values = sorted(values)
    return values[len(values) // 2]


def ours(tbucket, tensor_bytes):
    out = subprocess.run([tbucket, "bench", "--json", "--tensor-bytes", str(tensor_bytes)],
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        sys.exit(f"tbucket bench failed at {size_text(tensor_bytes)} a tensor (exit {out.returncode}):\n"
                 f"{out.stderr}{out.stdout}")
    copy, in_place = json.loads(out.stdout)
    return {"copy_us": copy["median_us"], "in_place_us": in_place["median_us"], "memcpy_us": copy["baseline_us"]}


def iceoryx(peer, tensor_bytes):
    bucket = TENSORS * tensor_bytes
    repeats = max(5, min(50, (4 << 30) // bucket))  # as tbucket bench chooses them
    out = subprocess.run([peer, str(tensor_bytes), str(repeats)], capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        sys.exit(f"iceoryx_handoff failed at {size_text(tensor_bytes)} a tensor:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def plot(table, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no plot: matplotlib is not installed (scripts/install-deps puts it in .venv)")
        return
    sizes = [row["bytes"] / (1 << 20) for row in table]
    figure, axes = plt.subplots(figsize=(8, 5))
    for key, label, style in [("copy_us", "tensorbucket copy: publish() -> verified views", "o-"),
                              ("fill_us", "iceoryx: loan + fill + publish -> take", "s-"),
                              ("memcpy_us", "one memcpy of the same bytes", "k--"),
                              ("in_place_us", "tensorbucket in place: commit() -> verified views", "o:"),
                              ("publish_us", "iceoryx: publish -> take", "s:")]:
        axes.plot(sizes, [row[key] for row in table], style, label=label)
    axes.set_xscale("log", base=2)
    axes.set_xticks(sizes, labels=[f"{size:.0f}" for size in sizes])
    axes.set_yscale("log")
    axes.set_xlabel("bucket (1000 tensors), MiB")
    axes.set_ylabel("median handoff, µs")
    axes.set_title("1000 tensors from one process to another (medians; lower is better)")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    print(f"plot: {path}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", default="build", help="the meson build directory")
    parser.add_argument("--rounds", type=int, default=3, help="turns at each size; figures are their medians")
    parser.add_argument("--plot", default="bench/iceoryx_sweep.png", help="where the PNG goes")
    args = parser.parse_args()
    build = pathlib.Path(args.build)
    tbucket, peer = build / "tools" / "tbucket", build / "bench" / "peers" / "iceoryx_handoff"
    if not peer.exists():
        sys.exit(f"{peer} was not built: scripts/install-deps --peers, then scripts/setup-build {build} "
                 f"and ninja -C {build}")
    print(f"load average before: {os.getloadavg()[0]:.2f} (a quiet machine is below 0.3)")
    turns = {n: {"ours": [], "iceoryx": []} for n in TENSOR_BYTES}
    # SIGTERM unwinds like Ctrl+C: RouDi is stopped and the config removed either way.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with tempfile.TemporaryDirectory(prefix="tbpeer-") as temp:
        config = pathlib.Path(temp) / "roudi.toml"
        roudi_config(config)
        roudi = start_roudi(config, pathlib.Path(temp) / "roudi.log")
        try:
            for round_ in range(args.rounds):
                for n in TENSOR_BYTES:
                    runs = [("ours", lambda: ours(str(tbucket), n)), ("iceoryx", lambda: iceoryx(str(peer), n))]
                    for name, run in runs if round_ % 2 == 0 else reversed(runs):
                        turns[n][name].append(run())
        finally:
            stop_roudi(roudi)
    print(f"load average after: {os.getloadavg()[0]:.2f}")

    table = []
    for n in TENSOR_BYTES:
        row = {"tensor_bytes": n, "bytes": TENSORS * n}
        for key in ("copy_us", "in_place_us", "memcpy_us"):
            row[key] = median([turn[key] for turn in turns[n]["ours"]])
        for key in ("fill_us", "publish_us"):
            row[key] = median([turn[key] for turn in turns[n]["iceoryx"]])
        row["iceoryx_memcpy_us"] = median([turn["memcpy_us"] for turn in turns[n]["iceoryx"]])
        table.append(row)
    print(f"\nmedians of {args.rounds} rounds, 1000 tensors a bucket, both consumers polling")
    print(f"{'bucket':>22} | {'tb copy':>10} {'iceoryx fill':>12} {'memcpy':>10} | {'copy/memcpy':>11} "
          f"{'copy/iceoryx':>12} | {'tb in place':>11} {'iceoryx pub':>11} {'ratio':>6}")
    for row in table:
        print(f"{bucket_text(row['tensor_bytes']):>22} | {row['copy_us']:10.1f} {row['fill_us']:12.1f} {row['memcpy_us']:10.1f} | "
              f"{row['copy_us'] / row['memcpy_us']:10.2f}x {row['copy_us'] / row['fill_us']:11.2f}x | "
              f"{row['in_place_us']:11.1f} {row['publish_us']:11.1f} {row['in_place_us'] / row['publish_us']:5.2f}x")
    print("µs; tb copy: publish() start -> the consumer holds verified views; iceoryx fill: loan() start ->"
          " take(); memcpy: one copy of the bucket's bytes between two warm buffers (tbucket bench's; the"
          " peer's own memcpy agrees within noise); in place: commit() -> verified views vs publish() -> take()")
    print(json.dumps(table))
    plot(table, args.plot)


if __name__ == "__main__":
    main()
