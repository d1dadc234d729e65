"""Two hosts on one machine: network namespaces joined by a veth pair, UCX's TCP transport
between them, `tbucket serve` on one and `tbucket relay` on the other (docs/network.md).

Needs root (the namespaces) and the network build of tbucket (TBUCKET names it); skipped
otherwise. Shared memory is the machine's, so the hosts' channels have different names."""
import collections
import hashlib
import hmac
import itertools
import json
import os
import random
import select
import shutil
import signal
import socket
import struct
import subprocess
import threading
import time
from pathlib import Path

import pytest

TBUCKET = os.environ.get("TBUCKET", "")


def tbucket_has_network():
    if not TBUCKET or not Path(TBUCKET).exists():
        return False
    help_text = subprocess.run([TBUCKET, "--help"], capture_output=True, text=True).stdout
    return "relay" in help_text


pytestmark = pytest.mark.skipif(not tbucket_has_network(), reason="tbucket built without UCX (no serve / relay)")
needs_root = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None,
                                reason="network namespaces need root and iproute2")


def ip(*args, check=True):
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


class Processes:
    """The processes of one test, each with its stdout in NAME.out and its stderr in NAME.err
    under the test's directory (appended to, so a name started again keeps one record); all of
    them stopped at the end."""

    def __init__(self, tmp_path):
        self.dir = tmp_path
        self.procs = []
        self.token = make_token(tmp_path / "token")

    def run(self, name, *command, env=None):
        with open(self.dir / f"{name}.out", "a") as out, open(self.dir / f"{name}.err", "a") as err:
            proc = subprocess.Popen(command, stdout=out, stderr=err, env=env)
        proc.name = name
        self.procs.append(proc)
        return proc

    def lines(self, name):
        """The complete lines of a process's stdout so far: it flushes in blocks, so the last
        one may still be half written, and is left out."""
        text = (self.dir / f"{name}.out").read_text()
        return text[:text.rfind("\n") + 1].splitlines()

    def text(self, name):
        return (self.dir / f"{name}.err").read_text()

    def close(self):
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class Hosts(Processes):
    """Namespaces `a` and `b`, one veth between them: 198.18.N.1 and 198.18.N.2 (RFC 2544's
    benchmarking range, on these veths only)."""

    def __init__(self, tmp_path):
        super().__init__(tmp_path)
        tag = f"{os.getpid() % 100000}"
        self.a, self.b = f"tbA{tag}", f"tbB{tag}"
        self.veth_a, self.veth_b = f"tbva{tag}", f"tbvb{tag}"
        subnet = os.getpid() % 250 + 1
        self.addr_a, self.addr_b = f"198.18.{subnet}.1", f"198.18.{subnet}.2"
        ip("netns", "add", self.a)
        ip("netns", "add", self.b)
        ip("link", "add", self.veth_a, "type", "veth", "peer", "name", self.veth_b)
        ip("link", "set", self.veth_a, "netns", self.a)
        ip("link", "set", self.veth_b, "netns", self.b)
        for ns, veth, addr in ((self.a, self.veth_a, self.addr_a), (self.b, self.veth_b, self.addr_b)):
            ip("-n", ns, "addr", "add", f"{addr}/24", "dev", veth)
            ip("-n", ns, "link", "set", veth, "up")
            ip("-n", ns, "link", "set", "lo", "up")
        self.suffix = tag

    def start(self, ns, name, *args, program=TBUCKET, env=None):
        """tbucket ARGS in namespace `ns`, over UCX's TCP transport."""
        return self.run(name, "ip", "netns", "exec", ns, program, *args,
                        env=dict(os.environ, UCX_TLS="tcp", **(env or {})))

    def link(self, up):
        ip("-n", self.a, "link", "set", self.veth_a, "up" if up else "down")

    def close(self):
        super().close()
        ip("netns", "del", self.a, check=False)
        ip("netns", "del", self.b, check=False)


class SameHost(Processes):
    """No namespaces: UCX picks its shared-memory transports between the processes. A trainer
    publishes on channel `up`; a relay republishes it on `down` for a consumer (`server`)."""

    serial = itertools.count()

    def __init__(self, tmp_path):
        super().__init__(tmp_path)
        tag = f"{os.getpid()}n{next(SameHost.serial)}"
        self.up, self.down = f"up{tag}", f"down{tag}"
        self.program = TBUCKET

    def start(self, name, *args, env=None):
        return self.run(name, self.program, *args, env=env)

    def trainer(self, interval_ms):
        """Small buckets every INTERVAL_MS, more than any test waits for."""
        return self.start("trainer", "produce", "--channel", self.up, "--buckets", "100000", "--tensors", "4",
                          "--tensor-bytes", "4096", "--interval-ms", str(interval_ms), "--quiet",
                          "--timeout-ms", "60000")

    def serve(self, address, name="serve", token=None, env=None):
        return self.start(name, "serve", "--channel", self.up, "--listen", address, "--token-file",
                          str(token or self.token), env=env)

    def relay(self, address, *args, env=None):
        return self.start("relay", "relay", "--connect", address, "--channel", self.up, "--as", self.down,
                          "--token-file", str(self.token), *args, env=env)

    def server(self, count, *args):
        """A consumer of `down` that verifies COUNT buckets, then exits."""
        return self.start("server", "consume", "--channel", self.down, "--buckets", str(count), "--verify",
                          "--json", "--quiet", "--timeout-ms", "60000", *args)


def make_token(path):
    path.write_bytes(os.urandom(24).hex().encode())
    path.chmod(0o600)
    return path


@pytest.fixture
def hosts(tmp_path):
    try:
        h = Hosts(tmp_path)
    except subprocess.CalledProcessError as e:  # root without the right to make namespaces
        ip("netns", "del", f"tbA{os.getpid() % 100000}", check=False)
        ip("netns", "del", f"tbB{os.getpid() % 100000}", check=False)
        pytest.skip(f"cannot make network namespaces: {e.stderr.strip()}")
    yield h
    h.close()


@pytest.fixture
def same_host(tmp_path):
    h = SameHost(tmp_path)
    yield h
    h.close()


def wait_for(condition, seconds, what):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.1)
    pytest.fail(f"timed out after {seconds} s waiting for {what}")


def buckets(h, name):
    """The consumer's JSON lines, each checked: verified, and newer than the one before."""
    seen = [json.loads(line) for line in h.lines(name) if line.startswith("{")]
    for line in seen:
        assert line["ok"], f"{name}: bucket {line} failed verification"
    versions = [line["version"] for line in seen]
    assert versions == sorted(set(versions)), f"{name}: a bucket came twice or out of order: {versions}"
    return versions


@needs_root
def test_trainer_relay_two_servers_every_byte_verified(hosts):
    h, count, port = hosts, 1000, 17001
    up, down = f"up{h.suffix}", f"down{h.suffix}"
    servers = [h.start(h.b, f"server{i}", "consume", "--channel", down, "--buckets", str(count), "--verify",
                       "--json", "--quiet", "--timeout-ms", "60000") for i in range(2)]
    h.start(h.b, "relay", "relay", "--connect", f"{h.addr_a}:{port}", "--channel", up, "--as", down,
            "--token-file", str(h.token), "--consumers", "2", "--buckets", str(count))
    h.start(h.a, "trainer", "produce", "--channel", up, "--buckets", str(count), "--tensors", "16",
            "--tensor-bytes", "1024", "--quiet", "--timeout-ms", "60000")
    h.start(h.a, "serve", "serve", "--channel", up, "--listen", f"{h.addr_a}:{port}", "--token-file", str(h.token))
    for server in servers:
        assert server.wait(timeout=120) == 0, h.text(server.name)
    for server in servers:
        assert buckets(h, server.name) == list(range(count))


@needs_root
def test_wrong_token_is_refused(hosts):
    h, port = hosts, 17002
    up = f"up{h.suffix}"
    h.start(h.a, "trainer", "produce", "--channel", up, "--buckets", "5", "--quiet", "--timeout-ms", "30000")
    h.start(h.a, "serve", "serve", "--channel", up, "--listen", f"{h.addr_a}:{port}", "--token-file", str(h.token))
    wrong = make_token(h.dir / "wrong")
    wait_for(lambda: "on " in h.text("serve"), 15, "serve to listen")
    relay = h.start(h.b, "relay", "relay", "--connect", f"{h.addr_a}:{port}", "--channel", up, "--as",
                    f"down{h.suffix}", "--token-file", str(wrong))
    assert relay.wait(timeout=30) == 9, h.text("relay")
    assert "Unauthorized" in h.text("relay")
    assert "wrong token" in h.text("serve")
    # A token file others may read is refused before anything is sent.
    wrong.chmod(0o644)
    relay = h.start(h.b, "relay2", "relay", "--connect", f"{h.addr_a}:{port}", "--channel", up,
                    "--token-file", str(wrong))
    assert relay.wait(timeout=30) == 6, h.text("relay2")


@needs_root
def test_killed_relay_serve_and_link_resume_without_torn_or_stale_buckets(hosts):
    h, count, port = hosts, 4000, 17003
    up, down = f"up{h.suffix}", f"down{h.suffix}"
    relay_args = ["relay", "--connect", f"{h.addr_a}:{port}", "--channel", up, "--as", down, "--token-file",
                  str(h.token), "--idle-timeout-ms", "1500", "--consumers", "0"]
    serve_args = ["serve", "--channel", up, "--listen", f"{h.addr_a}:{port}", "--token-file", str(h.token),
                  "--peer-timeout-ms", "2000"]
    servers = [h.start(h.b, f"server{i}", "consume", "--channel", down, "--follow", "--verify", "--json",
                       "--quiet", "--timeout-ms", "120000") for i in range(2)]
    relay = h.start(h.b, "relay", *relay_args)
    trainer = h.start(h.a, "trainer", "produce", "--channel", up, "--buckets", str(count), "--tensors", "8",
                      "--tensor-bytes", "4096", "--interval-ms", "2", "--quiet", "--timeout-ms", "60000")
    serve = h.start(h.a, "serve", *serve_args)
    got = lambda n: lambda: all(len(h.lines(s.name)) >= n for s in servers)

    wait_for(got(200), 60, "the first buckets")
    relay.kill()
    relay.wait()
    relay = h.start(h.b, "relay-again", *relay_args)
    wait_for(got(len(h.lines("server0")) + 200), 60, "buckets after the relay restarted")

    serve.kill()
    serve.wait()
    serve = h.start(h.a, "serve-again", *serve_args)
    wait_for(got(len(h.lines("server0")) + 200), 60, "buckets after the serve side restarted")

    h.link(False)
    time.sleep(3)
    h.link(True)
    assert trainer.poll() is None, "the trainer ended before the link came back: lower its pace"
    wait_for(got(len(h.lines("server0")) + 200), 60, "buckets after the link came back")

    assert trainer.wait(timeout=120) == 0, h.text("trainer")
    wait_for(lambda: all(buckets(h, s.name)[-1:] == [count - 1] for s in servers), 60, "the last bucket")
    for server in servers:
        versions = buckets(h, server.name)
        assert len(versions) > count // 4, f"{server.name} got only {len(versions)} buckets"


@needs_root
def test_random_kills_stops_and_link_flaps_deliver_no_torn_or_stale_bucket(hosts):
    """Thirty events drawn at random (seeded, so a failure replays the same list): the trainer,
    serve, the relay or a server killed with SIGKILL and started again, serve or the relay
    stopped for up to 4 s, the link down for up to 4 s. Updates of two buckets, small ones in
    one message and 2 MiB ones in chunks. After each event the stream resumes; every server
    run gets only verified buckets, never an older version than it had (a new trainer starts
    again at version 0), never more than the two buckets of one update; and once all stop,
    the machine's shared memory holds nothing of theirs."""
    rng = random.Random(22)
    h, port = hosts, 17011
    up, down = f"up{h.suffix}", f"down{h.suffix}"
    started = collections.Counter()
    running = {}

    def start(role, host, *args):
        started[role] += 1
        running[role] = h.start(host, f"{role}.{started[role]}", *args)

    def trainer():
        start("trainer", h.a, "produce", "--channel", up, "--buckets", "100000000", "--tensors", "8",
              "--tensor-bytes", str(rng.choice([4096, 262144])), "--update-buckets", "2", "--interval-ms", "3",
              "--quiet", "--timeout-ms", "600000")

    def serve():
        start("serve", h.a, "serve", "--channel", up, "--listen", f"{h.addr_a}:{port}", "--token-file",
              str(h.token), "--peer-timeout-ms", "2000")

    def relay():
        start("relay", h.b, "relay", "--connect", f"{h.addr_a}:{port}", "--channel", up, "--as", down,
              "--token-file", str(h.token), "--idle-timeout-ms", "1500", "--consumers", "0", "--update-buckets", "2")

    def server(i):
        start(f"server{i}", h.b, "consume", "--channel", down, "--follow", "--verify", "--json", "--quiet",
              "--timeout-ms", "600000")

    def received():
        return sum(len(h.lines(f"server0.{n}")) for n in range(1, started["server0"] + 1))

    restart = {"trainer": trainer, "serve": serve, "relay": relay,
               "server0": lambda: server(0), "server1": lambda: server(1)}
    server(0)
    server(1)
    relay()
    trainer()
    serve()
    wait_for(lambda: received() > 0, 60, "the first buckets")
    events = []
    for _ in range(30):
        time.sleep(rng.uniform(0.3, 2))
        event = rng.choice(["kill trainer", "kill serve", "kill relay", "kill server0", "kill server1",
                            "stop serve", "stop relay", "link down"])
        events.append(event)
        before = received()
        verb, role = event.split()
        if verb == "kill":
            running[role].kill()
            running[role].wait()
            restart[role]()
        elif verb == "stop":
            running[role].send_signal(signal.SIGSTOP)
            time.sleep(rng.uniform(0.5, 4))
            running[role].send_signal(signal.SIGCONT)
        else:
            h.link(False)
            time.sleep(rng.uniform(0.5, 4))
            h.link(True)
        wait_for(lambda: received() >= before + 4, 60, f"buckets after {events}")
        for role, proc in running.items():
            assert proc.poll() is None, f"{proc.name} exited after {events}: {h.text(proc.name)}"

    h.close()
    for role in ("server0", "server1"):
        for n in range(1, started[role] + 1):
            name = f"{role}.{n}"
            seen = [json.loads(line) for line in h.lines(name) if line.startswith("{")]
            assert all(line["ok"] for line in seen), f"{name}: a bucket failed verification"
            versions = [line["version"] for line in seen]
            older = [(a, b) for a, b in zip(versions, versions[1:]) if b < a and b != 0]
            assert not older, f"{name}: an older version after a newer one {older}, after {events}"
            same = [len(list(group)) for _, group in itertools.groupby(versions)]
            assert max(same, default=0) <= 2, f"{name}: an update of two buckets came with more, after {events}"
    assert not [entry for entry in os.listdir("/dev/shm") if up in entry or down in entry]


def cpu_seconds(pid):
    """The CPU time (user and system) process `pid` has taken, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@needs_root
@pytest.mark.parametrize("stopped", ["serve", "relay"])
def test_a_stopped_peer_does_not_keep_the_other_side_busy(hosts, stopped):
    """One side stops (SIGSTOP) while 32 MiB buckets stream: the other, its transfer standing
    still, sleeps between progress calls instead of spinning until its timeout; once the
    stopped side goes on, so does the stream, every bucket verified."""
    h, port = hosts, 17007
    up, down = f"up{h.suffix}", f"down{h.suffix}"
    h.start(h.b, "server", "consume", "--channel", down, "--follow", "--verify", "--json", "--quiet",
            "--timeout-ms", "60000")
    relay = h.start(h.b, "relay", "relay", "--connect", f"{h.addr_a}:{port}", "--channel", up, "--as", down,
                    "--token-file", str(h.token), "--idle-timeout-ms", "15000")
    h.start(h.a, "trainer", "produce", "--channel", up, "--buckets", "1000000", "--tensors", "16",
            "--tensor-bytes", str(2 << 20), "--quiet", "--timeout-ms", "60000")
    serve = h.start(h.a, "serve", "serve", "--channel", up, "--listen", f"{h.addr_a}:{port}", "--token-file",
                    str(h.token), "--peer-timeout-ms", "15000")
    wait_for(lambda: len(buckets(h, "server")) >= 5, 60, "the first buckets")
    logs = h.text("serve"), h.text("relay")
    halted, waiting = (serve, relay) if stopped == "serve" else (relay, serve)
    halted.send_signal(signal.SIGSTOP)
    try:
        time.sleep(0.5)  # past the 10 ms after which a transfer counts as standing still
        before = cpu_seconds(waiting.pid)
        time.sleep(3)  # well within both sides' timeouts
        busy = cpu_seconds(waiting.pid) - before
    finally:
        halted.send_signal(signal.SIGCONT)
    assert busy < 0.6, f"{waiting.name} took {busy:.2f} s of CPU in 3 s while {halted.name} was stopped"
    count = len(buckets(h, "server"))
    wait_for(lambda: len(buckets(h, "server")) >= count + 5, 60, "buckets after the stopped side went on")
    assert (h.text("serve"), h.text("relay")) == logs, "the link did not outlive the stop"


# A payload of one chunk (1 MiB) or less travels in the bucket's announce; a larger one in
# chunks, received into a buffer, or straight into a local slot from 4 MiB on. Tensor sizes
# that are not multiples of the payload's 256-byte alignment leave padding after each entry.
PAYLOADS = {"whole": ("4", "65000"), "chunks": ("3", "1048000"), "chunks_in_place": ("5", "1048000")}


# A payload byte flipped after the server hashed it, and a padding byte between the frame and a
# whole payload set (not covered by the hash): each bucket is refused. A payload in chunks
# whose hash never comes, while the server's heartbeats do (its own peer timeout made longer
# than the test): the relay gives up on it after its idle timeout.
WIRE_FAULTS = {"payload_whole": ("whole", "", "ChecksumMismatch"),
               "payload_chunks_in_place": ("chunks_in_place", "", "ChecksumMismatch"),
               "padding": ("whole", "padding:", "padding before its payload is not zero"),
               "hash_withheld": ("chunks_in_place", "nohash:", "no payload hash within")}


@needs_root
@pytest.mark.parametrize("fault", WIRE_FAULTS)
def test_a_byte_corrupted_on_the_wire_is_caught(hosts, fault):
    h, count, port, bad = hosts, 60, 17004, 20
    payload, prefix, caught = WIRE_FAULTS[fault]
    tensors, tensor_bytes = PAYLOADS[payload]
    up, down = f"up{h.suffix}", f"down{h.suffix}"
    server = h.start(h.b, "server", "consume", "--channel", down, "--verify", "--json", "--quiet", "--timeout-ms",
                     "30000")  # past the relay's wait for a hash withheld
    h.start(h.b, "relay", "relay", "--connect", f"{h.addr_a}:{port}", "--channel", up, "--as", down,
            "--token-file", str(h.token))
    h.start(h.a, "trainer", "produce", "--channel", up, "--buckets", str(count), "--tensors", tensors,
            "--tensor-bytes", tensor_bytes, "--quiet", "--timeout-ms", "30000")
    h.start(h.a, "serve", "serve", "--channel", up, "--listen", f"{h.addr_a}:{port}", "--token-file", str(h.token),
            "--peer-timeout-ms", "300000", program=os.environ["TBUCKET_WIRE_FAULT_BUILD"],
            env={"TBUCKET_WIRE_FAULT": f"{prefix}{bad}"})
    wait_for(lambda: buckets(h, "server")[-1:] == [count - 1], 60, "the last bucket")
    versions = buckets(h, "server")
    assert bad not in versions and bad - 1 in versions, versions
    assert caught in h.text("relay"), h.text("relay")
    server.send_signal(signal.SIGTERM)


@pytest.mark.parametrize("payload", PAYLOADS)
def test_same_host_through_shared_memory_transports(same_host, payload):
    h, count, address = same_host, 200, "127.0.0.1:17005"
    tensors, tensor_bytes = PAYLOADS[payload]
    server = h.server(count)
    relay = h.relay(address, "--buckets", str(count))
    h.start("trainer", "produce", "--channel", h.up, "--buckets", str(count), "--tensors", tensors, "--tensor-bytes",
            tensor_bytes, "--quiet", "--timeout-ms", "60000")
    h.serve(address)
    assert server.wait(timeout=120) == 0, h.text("server")
    assert buckets(h, "server") == list(range(count))
    assert relay.wait(timeout=30) == 0, h.text("relay")


# Where the trainer's channel lives, where the relay's does, and the payload: a device
# channel's payload is copied to host memory to be served, and a relay republishes wherever its
# own channel lives.
ROUTES = {"device_to_device": ("cuda:0", "cuda:1", "chunks"), "device_to_host": ("cuda:1", "host", "whole"),
          "host_to_device": ("host", "cuda:0", "chunks_in_place")}


@pytest.mark.parametrize("route", ROUTES)
def test_device_channels_are_served_and_relayed_through_host_memory(same_host, route):
    """Every process on the host stand-in of the CUDA driver (tests/device_standin.hpp), whose
    device memory is host memory, so that this runs without a GPU; scripts/gpu-check has no
    network case."""
    h, count, address = same_host, 100, "127.0.0.1:17010"
    source, target, payload = ROUTES[route]
    tensors, tensor_bytes = PAYLOADS[payload]
    h.program = os.environ["TBUCKET_DEVICE_STANDIN"]
    # The consumer refuses a channel whose payloads live elsewhere than the relay was told.
    server = h.server(count, "--device", target.split(":")[0])
    relay = h.relay(address, "--device", target, "--buckets", str(count))
    h.start("trainer", "produce", "--channel", h.up, "--device", source, "--buckets", str(count), "--tensors",
            tensors, "--tensor-bytes", tensor_bytes, "--quiet", "--timeout-ms", "60000")
    h.serve(address)
    assert server.wait(timeout=120) == 0, h.text("server")
    assert buckets(h, "server") == list(range(count))
    assert relay.wait(timeout=30) == 0, h.text("relay")


def listening_addresses(pid):
    """The addresses process `pid` listens on with TCP (from /proc: no tool needed)."""
    return {address for address, _ in listening_sockets(pid)}


def listening_sockets(pid):
    """The (address, port) pairs process `pid` listens on with TCP."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    addresses = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in inodes:  # LISTEN
                raw = bytes.fromhex(local.split(":")[0])
                # The kernel prints each 32-bit word in host order (little-endian here).
                address = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                addresses.add((socket.inet_ntop(socket.AF_INET if len(address) == 4 else socket.AF_INET6, address),
                               int(local.split(":")[1], 16)))
    return addresses


# The front door's messages (net/door.hpp): a header (kind, 3 reserved bytes, the length of
# what follows), then the message.
CHALLENGE, PROOF, WELCOME, REFUSED, ADDRESS = 1, 2, 3, 4, 5
MAGIC, PROTOCOL = b"TBNET\0\0\0", 3


def door_message(kind, body, length=None):
    return struct.pack("<B3xI", kind, len(body) if length is None else length) + body


def door_messages(link, seconds):
    """Every message that comes on `link` until it closes, as (kind, body): a refusal's body is
    its reason code and text."""
    link.settimeout(seconds)
    data = b""
    try:
        while chunk := link.recv(65536):
            data += chunk
    except (socket.timeout, ConnectionResetError):
        pass
    messages = []
    while len(data) >= 8:
        kind, length = struct.unpack_from("<B3xI", data)
        messages.append((kind, data[8:8 + length]))
        data = data[8 + length:]
    return messages


def open_files(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))


def cpu_seconds(pid):
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_connections_that_never_prove_the_token_are_capped_and_refused(same_host):
    """Nine connections that never send a proof: the server challenges eight, turns the ninth
    away at once, saying why, refuses the eight after 3 s, and a genuine relay that came
    meanwhile gets in after them."""
    h, count, address = same_host, 20, "127.0.0.1:17006"
    h.trainer(interval_ms=5)
    serve = h.serve(address)
    wait_for(lambda: "on 127.0.0.1" in h.text("serve"), 30, "serve to listen")
    links = [socket.create_connection(("127.0.0.1", 17006), timeout=5) for _ in range(8)]
    time.sleep(0.2)  # the eight at the door first
    ninth = socket.create_connection(("127.0.0.1", 17006), timeout=5)
    turned_away = door_messages(ninth, 5)
    assert [kind for kind, _ in turned_away] == [REFUSED], turned_away
    assert b"8 connections proving the token already" in turned_away[0][1]
    relay = h.relay(address)
    server = h.server(count)
    started = time.monotonic()
    for link in links:
        messages = door_messages(link, 10)
        assert [kind for kind, _ in messages] == [CHALLENGE, REFUSED], messages
        assert messages[1][1] == b"\x02no proof of the token within 3 s", messages
        assert len(messages[0][1]) == 56 and messages[0][1][:12] == MAGIC + struct.pack("<I", PROTOCOL)
        link.close()
    assert time.monotonic() - started < 6
    # UCX's own listening sockets (its TCP transport's) are held to the listen address's
    # interface too, not opened on every interface.
    wait_for(lambda: "connected to" in h.text("relay"), 30, "the relay to get in")
    assert listening_addresses(serve.pid) == {"127.0.0.1"}
    assert listening_addresses(relay.pid) == {"127.0.0.1"}  # the relay's, towards the server
    assert "no proof of the token within 3 s" in h.text("serve")
    assert server.wait(timeout=60) == 0, h.text("relay")
    assert len(buckets(h, "server")) == count


def proof_for(token, challenge_body):
    """A relay's proof of `token` for serve's challenge (net/token.cpp)."""
    key, nonce = struct.unpack_from("<Q", challenge_body, 16)[0], challenge_body[24:56]
    return hmac.new(token, b"tensorbucket peer proof" + nonce + struct.pack("<Q", key), hashlib.sha256).digest()


def test_a_proof_with_its_reserved_field_set_is_refused_and_a_proved_relay_is_told_what_it_did_not_send(same_host):
    """The right token's proof with the reserved field set is refused (a later version may give
    it a meaning); one that proves the token and then sends no worker address is told that,
    not that it proved nothing."""
    h, port = same_host, 17035
    h.trainer(interval_ms=5)
    serve = h.serve(f"127.0.0.1:{port}")
    wait_for(lambda: "on 127.0.0.1" in h.text("serve"), 30, "serve to listen")
    token = h.token.read_bytes()
    for reserved, kinds, said in ((7, [REFUSED], b"\x02the proof's reserved field is not zero"),
                                  (0, [WELCOME, ADDRESS, REFUSED], b"\x02no worker address within 3 s (the token was proved)")):
        link = socket.create_connection(("127.0.0.1", port), timeout=5)
        challenge_body = b""
        while len(challenge_body) < 8 + 56:
            challenge_body += link.recv(8 + 56 - len(challenge_body))
        assert challenge_body[0] == CHALLENGE
        body = MAGIC + struct.pack("<II", PROTOCOL, reserved) + proof_for(token, challenge_body[8:]) + os.urandom(32)
        link.sendall(door_message(PROOF, body))
        messages = door_messages(link, 10)
        link.close()
        assert [kind for kind, _ in messages] == kinds, messages
        assert messages[-1][1] == said, messages
    assert stopped_cleanly(serve), h.text("serve")


def test_idle_connections_are_not_held(same_host):
    """500 connections that never send: serve holds 8 of them at most, each 3 s at most, turns
    the rest away at once, does not spin meanwhile, and then serves a relay."""
    h, count, port = same_host, 20, 17020
    h.trainer(interval_ms=5)
    serve = h.serve(f"127.0.0.1:{port}")
    wait_for(lambda: "on 127.0.0.1" in h.text("serve"), 30, "serve to listen")
    before, cpu_before = open_files(serve.pid), cpu_seconds(serve.pid)
    links = []
    try:
        for _ in range(500):
            links.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        time.sleep(1)
        held = open_files(serve.pid) - before
        assert held <= 8, f"serve holds {held} more descriptors with 500 idle connections"
        time.sleep(3.5)
        assert open_files(serve.pid) <= before + 2, "serve still holds idle connections after 4.5 s"
        assert cpu_seconds(serve.pid) - cpu_before < 1.5, "serve spun while the connections sat there"
    finally:
        for link in links:
            link.close()
    h.relay(f"127.0.0.1:{port}")
    server = h.server(count)
    assert server.wait(timeout=60) == 0, h.text("relay")
    assert len(buckets(h, "server")) == count
    assert stopped_cleanly(serve), h.text("serve")


def test_a_server_out_of_descriptors_turns_connections_away_and_serves_again(same_host):
    """serve held to a few descriptors more than it uses, and 300 connections that never send:
    it turns those it cannot take away at once (a spare descriptor makes room to), rather than
    leave them in the listening queue ahead of relays, does not spin, and serves a relay while
    they are still open."""
    h, count, port = same_host, 20, 17023
    h.trainer(interval_ms=5)
    probe = h.serve(f"127.0.0.1:{port}", name="probe")
    wait_for(lambda: "on 127.0.0.1" in h.text("probe"), 30, "serve to listen")
    used = open_files(probe.pid)
    assert stopped_cleanly(probe), h.text("probe")
    limit = used + 8
    serve = h.run("serve", "prlimit", f"--nofile={limit}:{limit}", TBUCKET, "serve", "--channel", h.up, "--listen",
                  f"127.0.0.1:{port}", "--token-file", str(h.token))
    wait_for(lambda: "on 127.0.0.1" in h.text("serve"), 30, "serve to listen")
    cpu_before = cpu_seconds(serve.pid)
    links = []
    try:
        for _ in range(300):
            links.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        time.sleep(1)
        assert cpu_seconds(serve.pid) - cpu_before < 1.5, "serve spun while out of descriptors"
        h.relay(f"127.0.0.1:{port}")
        server = h.server(count)
        assert server.wait(timeout=60) == 0, h.text("serve") + h.text("relay")
    finally:
        for link in links:
            link.close()
    assert len(buckets(h, "server")) == count
    assert "away: out of descriptors" in h.text("serve")
    assert stopped_cleanly(serve), h.text("serve")


def hold_ucx_ports(pid, door_port, count):
    """COUNT connections that never send to the TCP ports UCX listens on in process `pid` (all
    but its front door), as many as it accepts."""
    ports = {port for _, port in listening_sockets(pid)} - {door_port}
    assert ports, "UCX listens on no port of its own"
    links = []
    for port in sorted(ports):
        for _ in range(count):
            try:
                links.append(socket.create_connection(("127.0.0.1", port), timeout=5))
            except OSError:  # refused: the port is closed
                break
    return links


def test_a_serve_whose_ucx_port_ran_out_of_descriptors_ends_saying_why(same_host):
    """UCX holds each connection to its own listening port until the peer speaks, and closes
    the port for good when an accept fails for want of descriptors: serve then let relays in
    that could never reach it, and looked alive. It ends instead (status 8, saying why), for a
    supervisor to restart; UCX's log is on stderr, not on stdout."""
    h, port, limit = same_host, 17029, 96
    h.trainer(interval_ms=5)
    serve = h.run("serve", "prlimit", f"--nofile={limit}:{limit}", TBUCKET, "serve", "--channel", h.up, "--listen",
                  f"127.0.0.1:{port}", "--token-file", str(h.token))
    wait_for(lambda: "on 127.0.0.1" in h.text("serve"), 30, "serve to listen")
    links = hold_ucx_ports(serve.pid, port, limit + 16)
    try:
        assert serve.wait(timeout=30) == 8, h.text("serve")
    finally:
        for link in links:
            link.close()
    assert "NetworkError: UCX closed its listening socket" in h.text("serve")
    assert "out of descriptors" in h.text("serve")
    assert (h.dir / "serve.out").read_text() == "", "UCX's log went to stdout"


def test_a_relay_whose_ucx_cannot_make_a_worker_any_more_ends_saying_why(same_host):
    """The same on the relay's side: once UCX closed its port, every worker it makes later in
    that process is refused ("Element already exists", UCX 1.22), and the relay used to try
    again every 2 s for ever. It ends (status 8) at the next link instead, once the attacker
    has gone (what fails while it holds the descriptors is tried again)."""
    h, port, limit = same_host, 17031, 96
    h.trainer(interval_ms=5)
    serve = h.serve(f"127.0.0.1:{port}")
    wait_for(lambda: "on 127.0.0.1" in h.text("serve"), 30, "serve to listen")
    relay = h.run("relay", "prlimit", f"--nofile={limit}:{limit}", TBUCKET, "relay", "--connect",
                  f"127.0.0.1:{port}", "--channel", h.up, "--as", h.down, "--token-file", str(h.token))
    wait_for(lambda: "connected to" in h.text("relay"), 30, "the relay to connect")
    links = hold_ucx_ports(relay.pid, -1, limit + 16)
    for link in links:  # gone: descriptors are not what the relay then lacks
        link.close()
    assert stopped_cleanly(serve), h.text("serve")  # the link ends: the relay makes a new worker
    assert relay.wait(timeout=30) == 8, h.text("relay")
    assert "NetworkError: ucp_worker_create" in h.text("relay")
    assert "makes no worker any more" in h.text("relay")


def test_relays_proving_the_token_together_get_max_peers_places(same_host):
    """Four relays connecting at once to a server with `--max-peers 1`: proofs that arrive
    together are counted with the relays still sending their address, so one relay is served
    and the others are refused, saying why, for as long as it stays."""
    h, port = same_host, 17022
    h.trainer(interval_ms=5)
    serve = h.start("serve", "serve", "--channel", h.up, "--listen", f"127.0.0.1:{port}", "--token-file",
                    str(h.token), "--max-peers", "1")
    wait_for(lambda: "on 127.0.0.1" in h.text("serve"), 30, "serve to listen")
    relays = [h.start(f"relay{i}", "relay", "--connect", f"127.0.0.1:{port}", "--channel", h.up, "--as",
                      f"{h.down}r{i}", "--token-file", str(h.token)) for i in range(4)]
    wait_for(lambda: sum(h.text(f"relay{i}").count("max_peers (1) reached") for i in range(4)) >= 6, 30,
             "the other relays to be refused, and to retry")
    assert h.text("serve").count("serving 127.0.0.1") == 1, h.text("serve")
    assert all(relay.poll() is None for relay in relays)
    assert stopped_cleanly(serve), h.text("serve")


def measured_env():
    """The environment of a process whose memory a test measures. Under AddressSanitizer,
    freed memory waits in a quarantine (256 MiB by default) before it is used again; a flood of
    small messages, each received and freed, fills it (the relay grew by 73 MiB so on UCX 1.22,
    none without it). No quarantine there, so that RSS counts what the process holds."""
    options = os.environ.get("ASAN_OPTIONS")
    return None if options is None else dict(os.environ, ASAN_OPTIONS=options + ":quarantine_size_mb=0")


def anonymous_rss_mib(pid):
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no RssAnon for {pid}")


class Flood:
    """`links` threads, each connecting to 127.0.0.1:`port` again and again and sending `data`
    as fast as the connection takes it until the other side closes it, for `seconds`. With
    `first`, what a thread sends first on each connection. As a server (`serve=True`), it
    listens instead and sends `first`, then `data` over and over, to whoever connects."""

    def __init__(self, port, data, seconds, links=1, first=b"", serve=False):
        self.port, self.data, self.first = port, data, first
        self.until = time.monotonic() + seconds
        self.connections, self.sent = 0, 0
        self.lock = threading.Lock()
        self.listener = socket.create_server(("127.0.0.1", port)) if serve else None
        target = self.accept if serve else self.connect
        self.threads = [threading.Thread(target=target, daemon=True) for _ in range(links)]
        for thread in self.threads:
            thread.start()

    def flood(self, link):
        with self.lock:
            self.connections += 1
        link.settimeout(2)
        try:
            link.sendall(self.first)
            while time.monotonic() < self.until:
                link.sendall(self.data)
                with self.lock:
                    self.sent += 1
        except OSError:
            pass  # closed by the other side, or stuck: next connection
        finally:
            link.close()

    def connect(self):
        while time.monotonic() < self.until:
            try:
                self.flood(socket.create_connection(("127.0.0.1", self.port), timeout=2))
            except OSError:
                time.sleep(0.01)

    def accept(self):
        self.listener.settimeout(0.2)
        while time.monotonic() < self.until:
            try:
                link, _ = self.listener.accept()
            except socket.timeout:
                continue
            threading.Thread(target=self.flood, args=(link,), daemon=True).start()

    def running(self):
        return time.monotonic() < self.until

    def close(self):
        self.until = 0
        for thread in self.threads:
            thread.join()
        if self.listener:
            self.listener.close()


def test_a_flood_from_links_without_the_token_neither_piles_up_nor_stalls_a_relay(same_host):
    """Eight threads connect to the front door again and again and send bytes as fast as it
    takes them, proofs of a wrong token or garbage: the server's memory stays put, also when it
    was held up and finds a backlog, and the relay it serves meanwhile is neither dropped nor
    late."""
    h, count, port = same_host, 300, 17008
    address = f"127.0.0.1:{port}"
    h.trainer(interval_ms=10)
    serve = h.serve(address, env=measured_env())
    wait_for(lambda: "on 127.0.0.1" in h.text("serve"), 30, "serve to listen")
    h.relay(address)
    server = h.server(count)
    wait_for(lambda: "serving 127.0.0.1" in h.text("serve"), 30, "the relay to get in")
    before = peak = anonymous_rss_mib(serve.pid)
    proof = door_message(PROOF, MAGIC + struct.pack("<II", PROTOCOL, 0) + os.urandom(64))
    floods = [Flood(port, proof, 8, links=4), Flood(port, os.urandom(4096), 8, links=4)]
    try:
        time.sleep(1)
        # serve held up for a while once the flood is on, as on a loaded host: it comes back to
        # a backlog of it
        serve.send_signal(signal.SIGSTOP)
        time.sleep(1.5)
        serve.send_signal(signal.SIGCONT)
        while any(flood.running() for flood in floods):
            peak = max(peak, anonymous_rss_mib(serve.pid))
            time.sleep(0.05)
    finally:
        for flood in floods:
            flood.close()
    assert all(flood.connections > 8 for flood in floods), [flood.connections for flood in floods]
    assert peak - before < 64, f"serve grew from {before:.0f} to {peak:.0f} MiB under the flood"
    assert "refused 127.0.0.1" in h.text("serve")
    assert server.wait(timeout=60) == 0, h.text("server")
    assert len(buckets(h, "server")) == count
    assert "dropped" not in h.text("serve")


def challenge(key=1):
    return door_message(CHALLENGE, MAGIC + struct.pack("<IIQ", PROTOCOL, 0, key) + os.urandom(32))


@pytest.mark.parametrize("mode, port, said", [
    ("heartbeats", 17012, "a message of kind 8 where a challenge was due"),
    ("welcomes", 17013, "a message of kind 3 where a challenge was due"),
    ("challenges", 17014, "a message of kind 1 where a welcome was due"),
    ("huge", 17021, "a challenge of 4294967295 bytes"),
])
def test_a_server_without_the_token_that_floods_the_handshake_neither_fills_a_relay_nor_stops_it(
        same_host, mode, port, said):
    """Whoever answers at the relay's address, token or not, can send at the front door:
    messages the handshake does not wait for there (heartbeats, welcomes or a challenge of 4 GiB
    where the challenge is due, challenges after it) drop the connection at once, the relay's
    memory stays put, it says why, and it keeps trying until the real server is back."""
    h, count, address = same_host, 50, f"127.0.0.1:{port}"
    first, data = {
        "heartbeats": (b"", door_message(8, bytes(8))),
        "welcomes": (b"", door_message(WELCOME, bytes(288))),
        "challenges": (challenge(), challenge()),
        "huge": (door_message(CHALLENGE, b"", length=2**32 - 1), os.urandom(65536)),
    }[mode]
    flooder = Flood(port, data, 6, first=first, serve=True)
    try:
        relay = h.relay(address, env=measured_env())
        wait_for(lambda: flooder.connections >= 1, 30, "the relay to connect")
        before = peak = anonymous_rss_mib(relay.pid)  # past UCX's start-up: its worker is made
        while flooder.running():
            peak = max(peak, anonymous_rss_mib(relay.pid))
            time.sleep(0.05)
    finally:
        flooder.close()
    assert peak - before < 32, f"the relay grew from {before:.0f} to {peak:.0f} MiB under the flood"
    assert said in h.text("relay")
    assert flooder.connections >= 2, flooder.connections  # the relay came back after the drop
    assert relay.poll() is None, h.text("relay")
    h.trainer(interval_ms=10)
    h.serve(address)
    server = h.server(count)
    assert server.wait(timeout=60) == 0, h.text("relay")
    assert len(buckets(h, "server")) == count


def test_a_relay_once_served_outlasts_a_refusal_of_its_token(same_host):
    """A relay refused at its first connect exits (test_wrong_token_is_refused); once a server
    took its token, whatever refuses it later (here another server on the same port, with
    another token, as an impostor would be) is tried again, and it resumes when the real server
    is back."""
    h, count, address = same_host, 400, "127.0.0.1:17009"
    h.trainer(interval_ms=10)
    serve = h.serve(address)
    wait_for(lambda: "on 127.0.0.1" in h.text("serve"), 30, "serve to listen")
    relay = h.relay(address)
    server = h.server(count)
    wait_for(lambda: len(h.lines("server")) >= 20, 30, "buckets through the relay")
    serve.send_signal(signal.SIGTERM)
    serve.wait(timeout=15)
    impostor = h.serve(address, name="impostor", token=make_token(h.dir / "other-token"))
    wait_for(lambda: h.text("impostor").count("wrong token") >= 2, 30, "the relay to try again after a refusal")
    assert relay.poll() is None, h.text("relay")
    assert server.poll() is None, "the consumer finished before the impostor came"
    impostor.send_signal(signal.SIGTERM)
    impostor.wait(timeout=15)
    h.serve(address)
    assert server.wait(timeout=60) == 0, h.text("server")
    assert len(buckets(h, "server")) == count  # each verified, none twice, in order
    assert "Unauthorized" in h.text("relay") and "reconnecting" in h.text("relay"), h.text("relay")


def resolves_through_resolv_conf():
    """glibc asks the DNS servers of /etc/resolv.conf (which `ip netns exec` can replace) for
    host names: nsswitch names `dns`, and not systemd-resolved."""
    try:
        hosts = [line.split()[1:] for line in Path("/etc/nsswitch.conf").read_text().splitlines()
                 if line.startswith("hosts:")]
    except OSError:
        return False
    return bool(hosts) and "dns" in hosts[0] and "resolve" not in hosts[0]


@needs_root
@pytest.mark.skipif(not resolves_through_resolv_conf(), reason="host names are not resolved through resolv.conf")
def test_a_resolver_that_never_answers_does_not_hang_the_relay(tmp_path):
    """A host name whose DNS server never answers (the queries go into a veth whose other end is
    down): the relay reports the resolver's silence within its connect timeout, again and
    again, instead of hanging in getaddrinfo()."""
    ns = f"tbdns{os.getpid() % 100000}"
    conf = Path("/etc/netns") / ns / "resolv.conf"  # `ip netns exec` mounts it over /etc/resolv.conf
    ip("netns", "add", ns)
    try:
        conf.parent.mkdir(parents=True, exist_ok=True)
        conf.write_text("nameserver 198.18.251.2\noptions timeout:5 attempts:3\n")
        ip("-n", ns, "link", "add", "sink", "type", "veth", "peer", "name", "sinkpeer")
        ip("-n", ns, "addr", "add", "198.18.251.1/24", "dev", "sink")
        ip("-n", ns, "link", "set", "sink", "up")
        ip("-n", ns, "neigh", "add", "198.18.251.2", "lladdr", "02:00:00:00:00:01", "dev", "sink", "nud", "permanent")
        relay = subprocess.Popen(["ip", "netns", "exec", ns, TBUCKET, "relay", "--connect", "weights.example:17000",
                                  "--channel", "x", "--token-file", str(make_token(tmp_path / "token")),
                                  "--timeout-ms", "1000"], stderr=subprocess.PIPE, text=True)
        try:
            time.sleep(4)
        finally:
            relay.send_signal(signal.SIGTERM)
            _, err = relay.communicate(timeout=30)
        assert err.count("the resolver gave no answer within 1000 ms") >= 2, err
    finally:
        ip("netns", "del", ns, check=False)
        shutil.rmtree(conf.parent, ignore_errors=True)


# Bytes from whoever reaches a port, before any token: short writes, a header declaring 2^64-1
# bytes (UCX's connection manager reads such a header; 1.13.1 aborted on each of these), garbage.
BYTES_BEFORE_ANY_TOKEN = [b"\0" * 16 + b"X", (2**64 - 1).to_bytes(8, "little") + b"\0" * 9, b"\xff" * 4096]


def ucx_connection_request(port):
    """What UCX's connection manager sends first to a server address (relays did, before the
    front door): a connection request, the client's worker address in it, taken by a plain
    TCP listener."""
    with socket.create_server(("127.0.0.1", port)) as listener:
        client = subprocess.Popen([os.environ["TBUCKET_UCX_REQUEST"], f"127.0.0.1:{port}", "3"])
        listener.settimeout(30)
        link, _ = listener.accept()
        with link:
            link.settimeout(1)
            request = b""
            try:
                while chunk := link.recv(65536):
                    request += chunk
            except socket.timeout:
                pass
    client.wait(timeout=15)
    assert len(request) > 16, request
    return request


def send_and_close(port, data):
    with socket.create_connection(("127.0.0.1", port), timeout=5) as link:
        try:
            link.sendall(data)
            time.sleep(0.01)
        except OSError:
            pass  # the other side closed first: as good


def stopped_cleanly(proc):
    """SIGTERM, then the exit a stop by signal gives (143), not an abort."""
    assert proc.poll() is None, f"{proc.name} ended on its own with {proc.returncode}"
    proc.send_signal(signal.SIGTERM)
    return proc.wait(timeout=30) == 128 + signal.SIGTERM


def test_bytes_before_any_token_do_not_kill_serve(same_host):
    """Short writes, a header declaring 2^64-1 bytes, garbage; UCX's own connection request,
    cut short at 100 places and with bytes changed inside its worker address at 200 (UCX 1.22
    aborted on those when its listener read them); and front-door messages of every kind and
    of absurd sizes: each on a connection of its own, serve outlives them all and then serves
    a relay every bucket."""
    h, count, port = same_host, 50, 17015
    request = ucx_connection_request(port)
    h.trainer(interval_ms=10)
    serve = h.serve(f"127.0.0.1:{port}")
    wait_for(lambda: "on 127.0.0.1" in h.text("serve"), 30, "serve to listen")
    rng = random.Random(42)
    mutated = []
    for _ in range(200):
        data = bytearray(request)
        for _ in range(rng.randrange(1, 4)):
            data[rng.randrange(16, len(data))] = rng.randrange(256)
        mutated.append(bytes(data))
    proof_body = MAGIC + struct.pack("<II", PROTOCOL, 0) + bytes(64)
    door = [door_message(kind, b"", length=length) for kind in (0, 1, 2, 3, 4, 5, 6, 8, 255) for length in (0, 80, 2**32 - 1)]
    door += [door_message(PROOF, proof_body), door_message(PROOF, proof_body + b"x"),
             door_message(PROOF, proof_body[:-1]), door_message(PROOF, proof_body) + b"\xff" * 4096,
             struct.pack("<B3BI", PROOF, 1, 2, 3, 80) + proof_body]
    for data in BYTES_BEFORE_ANY_TOKEN + [request[:rng.randrange(1, len(request))] for _ in range(100)] + mutated + door:
        send_and_close(port, data)
        assert serve.poll() is None, f"serve ended with {serve.returncode} after {data[:64]!r}: {h.text('serve')}"
    h.relay(f"127.0.0.1:{port}")
    server = h.server(count)
    assert server.wait(timeout=60) == 0, h.text("serve") + h.text("relay")
    assert len(buckets(h, "server")) == count
    assert stopped_cleanly(serve), h.text("serve")


class Impostor:
    """A plain TCP listener on the port that greets every connection with `answer` (serve speaks
    first) and closes it, counting the connections."""

    def __init__(self, port, answer):
        self.listener = socket.create_server(("127.0.0.1", port))
        self.listener.settimeout(0.2)
        self.answer, self.links, self.stopping = answer, 0, False
        self.thread = threading.Thread(target=self.run)
        self.thread.start()

    def run(self):
        while not self.stopping:
            try:
                link, _ = self.listener.accept()
            except socket.timeout:
                continue
            with link:
                link.settimeout(2)
                try:
                    link.sendall(self.answer)
                    time.sleep(0.05)
                except OSError:
                    pass
            self.links += 1

    def close(self):
        self.stopping = True
        self.thread.join()
        self.listener.close()


@pytest.mark.parametrize("answer, served_before", [(BYTES_BEFORE_ANY_TOKEN[0], False),
                                                    (BYTES_BEFORE_ANY_TOKEN[0], True),
                                                    (BYTES_BEFORE_ANY_TOKEN[1], True)],
                         ids=["17_bytes_to_a_new_relay", "17_bytes_to_a_relay_once_served", "length_2^64-1"])
def test_an_impostors_answer_does_not_kill_a_relay(same_host, answer, served_before):
    """Whoever answers at the relay's address, with bytes no UCX sends: the relay, new or once
    served, tries again, and delivers every bucket once the real server is on the port."""
    h, count, port = same_host, 60, 17016
    address = f"127.0.0.1:{port}"
    h.trainer(interval_ms=10)
    server = h.server(count)
    relay = None
    if served_before:
        serve = h.serve(address)
        relay = h.relay(address)
        wait_for(lambda: len(h.lines("server")) >= 10, 30, "buckets through the relay")
        assert stopped_cleanly(serve), h.text("serve")
    impostor = Impostor(port, answer)
    try:
        relay = relay or h.relay(address)
        wait_for(lambda: impostor.links >= 3, 30, "the relay to try the impostor three times")
    finally:
        impostor.close()
    assert relay.poll() is None, f"the relay ended with {relay.returncode}: {h.text('relay')}"
    h.serve(address)
    assert server.wait(timeout=60) == 0, h.text("relay")
    assert len(buckets(h, "server")) == count


@needs_root
def test_a_link_stalled_and_reconnected_mid_transfer_does_not_kill_serve(hosts):
    """16 MiB buckets over TCP; serve stopped for 2.5 s, longer than the relay's idle timeout,
    so that the relay drops the link mid-transfer and reconnects while serve, continued, still
    writes to the old one: eight times over, serve goes on, and so does the stream."""
    h, port = hosts, 17017
    up, down = f"up{h.suffix}", f"down{h.suffix}"
    h.start(h.b, "server", "consume", "--channel", down, "--follow", "--verify", "--json", "--quiet",
            "--timeout-ms", "60000")
    h.start(h.b, "relay", "relay", "--connect", f"{h.addr_a}:{port}", "--channel", up, "--as", down,
            "--token-file", str(h.token), "--idle-timeout-ms", "2000")
    h.start(h.a, "trainer", "produce", "--channel", up, "--buckets", "1000000", "--tensors", "8",
            "--tensor-bytes", str(2 << 20), "--quiet", "--timeout-ms", "60000")
    serve = h.start(h.a, "serve", "serve", "--channel", up, "--listen", f"{h.addr_a}:{port}", "--token-file",
                    str(h.token))
    for _ in range(8):
        seen = len(buckets(h, "server"))
        wait_for(lambda: len(buckets(h, "server")) >= seen + 2, 60, "buckets before the stall")
        serve.send_signal(signal.SIGSTOP)
        time.sleep(2.5)
        serve.send_signal(signal.SIGCONT)
        assert serve.poll() is None, h.text("serve")
    seen = len(buckets(h, "server"))
    wait_for(lambda: len(buckets(h, "server")) >= seen + 2, 60, "buckets after the last stall")
    assert h.text("relay").count("reconnecting") >= 1, h.text("relay")  # the stalls did cut links
    assert stopped_cleanly(serve), h.text("serve")


@needs_root
def test_relays_killed_as_they_connect_do_not_kill_serve(hosts):
    """Six relays at a time against `--max-peers 3`, each killed 0.2-1.5 s after it started,
    in the middle of connecting, proving the token or taking its first bucket, five rounds:
    serve goes on, and serves the relay that stays every bucket."""
    h, port, count = hosts, 17018, 100
    up = f"up{h.suffix}"
    h.start(h.a, "trainer", "produce", "--channel", up, "--buckets", "1000000", "--tensors", "4",
            "--tensor-bytes", str(256 << 10), "--interval-ms", "5", "--quiet", "--timeout-ms", "60000")
    serve = h.start(h.a, "serve", "serve", "--channel", up, "--listen", f"{h.addr_a}:{port}", "--token-file",
                    str(h.token), "--max-peers", "3")
    wait_for(lambda: "on " + h.addr_a in h.text("serve"), 30, "serve to listen")
    rng = random.Random(7)
    for round in range(5):
        relays = [h.start(h.b, f"churn{round}-{i}", "relay", "--connect", f"{h.addr_a}:{port}", "--channel", up,
                          "--as", f"churn{h.suffix}-{round}-{i}", "--token-file", str(h.token))
                  for i in range(6)]
        started = time.monotonic()
        for relay, delay in sorted(((relay, rng.uniform(0.2, 1.5)) for relay in relays), key=lambda pair: pair[1]):
            time.sleep(max(0.0, started + delay - time.monotonic()))
            relay.kill()
        for relay in relays:
            relay.wait(timeout=15)
        assert serve.poll() is None, h.text("serve")
    # What the killed relays left (those that got as far as their local channel), removed as
    # an operator would; nothing of theirs stays in /dev/shm.
    for round, i in itertools.product(range(5), range(6)):
        subprocess.run([TBUCKET, "rm", f"churn{h.suffix}-{round}-{i}"], capture_output=True)
    assert not [entry for entry in os.listdir("/dev/shm") if f"churn{h.suffix}-" in entry]
    down = f"down{h.suffix}"
    server = h.start(h.b, "server", "consume", "--channel", down, "--buckets", str(count), "--verify", "--json",
                     "--quiet", "--timeout-ms", "60000")
    h.start(h.b, "relay", "relay", "--connect", f"{h.addr_a}:{port}", "--channel", up, "--as", down,
            "--token-file", str(h.token))
    assert server.wait(timeout=90) == 0, h.text("serve") + h.text("relay")
    assert len(buckets(h, "server")) == count
    assert stopped_cleanly(serve), h.text("serve")


def ipv6_loopback():
    try:
        with socket.create_server(("::1", 0), family=socket.AF_INET6):
            return True
    except OSError:
        return False


@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback here")
def test_a_relay_over_ipv6(same_host):
    """serve on [::1], a relay connecting there: every bucket, and serve stops cleanly (it
    corrupted its heap when UCX's transport took IPv4 on an IPv6 link)."""
    h, count, address = same_host, 100, "[::1]:17019"
    h.trainer(interval_ms=5)
    serve = h.serve(address)
    wait_for(lambda: "on [::1]" in h.text("serve"), 30, "serve to listen")
    h.relay(address)
    server = h.server(count)
    assert server.wait(timeout=60) == 0, h.text("serve") + h.text("relay")
    assert len(buckets(h, "server")) == count
    assert "serving [::1]" in h.text("serve"), h.text("serve")
    assert stopped_cleanly(serve), h.text("serve")
