"""Runs `tbucket bench --json` and the Python peers in one go and prints our ratio against each.

/usr/bin/python3 bench/peers/compare.py build/tools/tbucket
"""
import json
import pathlib
import subprocess
import sys


def main():
    tbucket = sys.argv[1] if len(sys.argv) > 1 else "build/tools/tbucket"
    ours = {row["name"]: row for row in json.loads(subprocess.run(
        [tbucket, "bench", "--json"], check=True, capture_output=True, text=True).stdout)}
    peers = [json.loads(line) for line in subprocess.run(
        [sys.executable, str(pathlib.Path(__file__).with_name("python_peers.py"))],
        check=True, capture_output=True, text=True).stdout.splitlines()]
    for peer in peers:
        mine = ours["copy " + peer["size"]]
        print(f"{peer['size']:>16}: tensorbucket {mine['median_us']:10.1f} us | "
              f"{peer['peer']:>11} {peer['median_us']:10.1f} us | "
              f"{peer['median_us'] / mine['median_us']:7.1f}x faster")
    for name, row in ours.items():
        if row["baseline_us"]:
            print(f"{name:>22}: {row['median_us']:.1f} us vs {row['baseline']} {row['baseline_us']:.1f} us, "
                  f"{row['ratio']:.2f}x")


if __name__ == "__main__":
    main()
