"""Runs `tbucket bench --json` and the Python peers in one go and prints our ratio against each:
the Python handoff against each Python peer, the best first, and against a memcpy of the same
bytes (all from python_peers.py, which takes turns between them), then the C++ handoff against
each peer.

.venv/bin/python bench/peers/compare.py build/tools/tbucket
"""
import json
import os
import pathlib
import subprocess
import sys


def main():
    tbucket = sys.argv[1] if len(sys.argv) > 1 else "build/tools/tbucket"
    ours = {row["name"]: row for row in json.loads(subprocess.run(
        [tbucket, "bench", "--json"], check=True, capture_output=True, text=True).stdout)}
    python_dir = pathlib.Path(tbucket).resolve().parents[1] / "python"
    env = dict(os.environ, PYTHONPATH=str(python_dir))
    peers = [json.loads(line) for line in subprocess.run(
        [sys.executable, str(pathlib.Path(__file__).with_name("python_peers.py"))],
        check=True, capture_output=True, text=True, env=env).stdout.splitlines()]
    by_size = {}
    for peer in peers:
        by_size.setdefault(peer["size"], {})[peer["peer"]] = peer
    for size, rows in by_size.items():
        others = sorted((row for name, row in rows.items()
                         if not name.startswith("tensorbucket") and name != "memcpy"),
                        key=lambda row: row["median_us"])
        for ours_name in ("tensorbucket", "tensorbucket all views"):
            if ours_name not in rows:
                continue
            mine = rows[ours_name]
            print(f"{size:>16}: Python {ours_name:<22} {mine['median_us']:10.1f} us | "
                  f"{mine['median_us'] / rows['memcpy']['median_us']:.2f}x a memcpy of the same bytes | "
                  f"first of a turn {mine['cold_median_us']:.0f} us")
            for rank, peer in enumerate(others):
                # Each turn of ours beside the same round's turn of the peer.
                turns = [theirs / us for theirs, us in zip(peer["turn_medians_us"], mine["turn_medians_us"])]
                print(f"{'':>18}{'best peer' if rank == 0 else 'peer':>9} {peer['peer']:<15} "
                      f"{peer['median_us']:12.1f} us: {peer['median_us'] / mine['median_us']:8.1f}x faster "
                      f"(turns {min(turns):.1f}-{max(turns):.1f}x) | "
                      f"first of a turn {peer['cold_median_us']:.0f} us")
    for peer in peers:
        if peer["peer"].startswith("tensorbucket") or peer["peer"] == "memcpy":
            continue
        mine = ours["copy " + peer["size"]]
        print(f"{peer['size']:>16}: C++ tensorbucket {mine['median_us']:10.1f} us | "
              f"{peer['peer']:>15} {peer['median_us']:10.1f} us | "
              f"{peer['median_us'] / mine['median_us']:7.1f}x faster")
    for name, row in ours.items():
        if row["baseline_us"]:
            print(f"{name:>22}: {row['median_us']:.1f} us vs {row['baseline']} {row['baseline_us']:.1f} us, "
                  f"{row['ratio']:.2f}x")


if __name__ == "__main__":
    main()
