"""Runs `tbucket bench --json` and the Python peers in one go and prints our ratio against each.

/usr/bin/python3 bench/peers/compare.py build/tools/tbucket
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
        by_size.setdefault(peer["size"], {})[peer["peer"]] = peer["median_us"]
    for size, medians in by_size.items():
        best = min(v for k, v in medians.items() if not k.startswith("tensorbucket"))
        for ours_name in ("tensorbucket", "tensorbucket all views"):
            if ours_name in medians:
                print(f"{size:>16}: Python {ours_name:<22} {medians[ours_name]:10.1f} us, "
                      f"best Python peer {best:10.1f} us, {best / medians[ours_name]:7.1f}x faster")
    for peer in peers:
        if peer["peer"].startswith("tensorbucket"):
            continue
        mine = ours["copy " + peer["size"]]
        print(f"{peer['size']:>16}: C++ tensorbucket {mine['median_us']:10.1f} us | "
              f"{peer['peer']:>11} {peer['median_us']:10.1f} us | "
              f"{peer['median_us'] / mine['median_us']:7.1f}x faster")
    for name, row in ours.items():
        if row["baseline_us"]:
            print(f"{name:>22}: {row['median_us']:.1f} us vs {row['baseline']} {row['baseline_us']:.1f} us, "
                  f"{row['ratio']:.2f}x")


if __name__ == "__main__":
    main()
