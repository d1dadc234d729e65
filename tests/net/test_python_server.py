"""tensorbucket.Server and tensorbucket.Relay, the Python sides of `tbucket serve` and `tbucket
relay`, on this host (UCX's shared-memory and loopback transports): a Python trainer's buckets
served from Python, relayed by `tbucket relay` or a Python Relay, received by a Python
Subscriber byte for byte; their errors; and how many relays a server admits (`--max-peers`).

Needs the Python module built with UCX (PYTHONPATH, as the `net` suite sets it) and the network
build of tbucket (TBUCKET)."""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from test_hosts import TBUCKET, make_token, tbucket_has_network, wait_for

tensorbucket = pytest.importorskip("tensorbucket")
pytestmark = [
    pytest.mark.skipif(not hasattr(tensorbucket._C, "Server"), reason="tensorbucket built without UCX"),
    pytest.mark.skipif(not tbucket_has_network(), reason="tbucket built without UCX (no relay)"),
]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def weights(version):
    """A small model's worth of tensors, different at every version."""
    generator = torch.Generator().manual_seed(version)
    return {
        "embed.weight": torch.randn(64, 256, generator=generator),
        "layers.0.bias": torch.arange(300, dtype=torch.int64) * version,
        "head.weight": torch.randn(32, 33, generator=generator).to(torch.bfloat16),
        "scale": torch.tensor(float(version)),
    }


@pytest.fixture
def procs():
    started = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in started:
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def relay(procs, tmp_path, name, address, up, down, token, *args):
    log = open(tmp_path / f"{name}.log", "w")
    proc = subprocess.Popen([TBUCKET, "relay", "--connect", address, "--channel", up, "--as", down, "--token-file",
                             str(token), *args], stdout=log, stderr=subprocess.STDOUT)
    procs.append(proc)
    return proc


def test_python_trainer_served_from_python_reaches_a_python_server_byte_for_byte(tmp_path, procs):
    token = make_token(tmp_path / "token")
    tag, count = os.getpid(), 40
    up, down = f"pyup{tag}", f"pydown{tag}"
    errors = []

    def train():
        try:
            with tensorbucket.Publisher(up, slots=2) as publisher:
                for version in range(count):
                    publisher.publish(weights(version), version=version, timeout=60)
                publisher.drain(timeout=60)
        except Exception as e:  # reported by the main thread
            errors.append(e)

    trainer = threading.Thread(target=train)
    trainer.start()
    with tensorbucket.Server(up, f"127.0.0.1:{free_port()}", token, peer_timeout=5, timeout=30) as server:
        serving = threading.Thread(target=server.serve)  # until close()
        serving.start()
        relay(procs, tmp_path, "relay", server.address, up, down, token)
        with tensorbucket.Subscriber(down, timeout=30) as subscriber:
            for version in range(count):
                bucket = subscriber.next(timeout=30)
                assert bucket is not None, (tmp_path / "relay.log").read_text()
                assert bucket.version == version
                expected = weights(version)
                assert sorted(bucket.keys()) == sorted(expected)
                for name, tensor in expected.items():
                    assert bucket[name].dtype == tensor.dtype and torch.equal(bucket[name], tensor), name
                bucket.release()
        wait_for(lambda: server.peers == 1, 5, "the relay among the peers")  # as of serve()'s last slice
        trainer.join(timeout=60)
        assert not errors, errors
        server.close()  # from this thread: serve() in the other one returns
        serving.join(timeout=10)
        assert not serving.is_alive()
        assert server.buckets_served == count and server.peers == 0
    with pytest.raises(tensorbucket.InvalidArgument, match="closed"):
        server.serve(0.1)


def test_ctrl_c_ends_a_relay_without_a_limit_while_its_link_is_up(tmp_path):
    """SIGINT, once a bucket was relayed and the link waits for the next, ends relay() (no time
    limit) with KeyboardInterrupt within seconds: the wait for the link asks Python's signal
    handlers, and what they raised is not lost."""
    token = make_token(tmp_path / "token")
    tag = os.getpid()
    up, down = f"pyiup{tag}", f"pyidown{tag}"
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with tensorbucket.Publisher(up, slots=2) as publisher, \
                tensorbucket.Server(up, f"127.0.0.1:{free_port()}", token, peer_timeout=5, timeout=30) as server:
            serving = threading.Thread(target=server.serve)  # until close()
            serving.start()
            publisher.publish(weights(0), timeout=30)
            with tensorbucket.Relay(server.address, up, token, local=down, timeout=30) as relay:
                sent = []

                def interrupt_once_relayed():
                    give_up = time.monotonic() + 30
                    while relay.buckets_relayed < 1 and time.monotonic() < give_up:
                        time.sleep(0.05)
                    time.sleep(0.3)  # into the wait for the next bucket
                    sent.append(time.monotonic())
                    os.kill(os.getpid(), signal.SIGINT)
                    time.sleep(20)
                    relay.close()  # a lost Ctrl+C: relay() then returns, and the test fails

                threading.Thread(target=interrupt_once_relayed, daemon=True).start()
                with pytest.raises(KeyboardInterrupt):
                    relay.relay()
                assert time.monotonic() - sent[0] < 10
                assert relay.buckets_relayed == 1
            server.close()
            serving.join(timeout=10)
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_python_relay_republishes_a_python_server_byte_for_byte(tmp_path):
    """Both ends in Python: a Relay in a thread republishes what a Server serves into a local
    channel, every bucket verified and in order; close() ends a relay() without a limit, and a
    Relay's wrong token and wrong channel are errors, not retries."""
    token = make_token(tmp_path / "token")
    tag, count = os.getpid(), 12
    up, down = f"pyrup{tag}", f"pyrdown{tag}"
    with tensorbucket.Publisher(up, slots=2) as publisher, \
            tensorbucket.Server(up, f"127.0.0.1:{free_port()}", token, peer_timeout=5, timeout=30) as server:
        serving = threading.Thread(target=server.serve)  # until close()
        serving.start()
        with tensorbucket.Relay(server.address, up, token, local=down, timeout=30) as relay:
            assert relay.local_channel == down
            relaying = threading.Thread(target=relay.relay)  # until close()
            relaying.start()
            with tensorbucket.Subscriber(down, timeout=30) as subscriber:
                wait_for(lambda: server.peers == 1, 30, "the relay among the peers")
                for version in range(count):
                    publisher.publish(weights(version), version=version, timeout=30)
                    bucket = subscriber.next(timeout=30)
                    assert bucket is not None and bucket.version == version
                    expected = weights(version)
                    assert sorted(bucket.keys()) == sorted(expected)
                    for name, tensor in expected.items():
                        assert bucket[name].dtype == tensor.dtype and torch.equal(bucket[name], tensor), name
                    bucket.release()
            relay.close()  # from this thread: relay() in the other one returns
            relaying.join(timeout=10)
            assert not relaying.is_alive()
            assert relay.buckets_relayed == count
        with pytest.raises(tensorbucket.InvalidArgument, match="closed"):
            relay.relay(0.1)

        wrong = tmp_path / "wrong"
        wrong.write_text("another secret, long enough\n")
        wrong.chmod(0o600)
        with tensorbucket.Relay(server.address, up, wrong, local=f"{down}w", timeout=2) as impostor:
            with pytest.raises(tensorbucket.NetworkError) as refused:
                impostor.relay(10)
            assert refused.value.code == "Unauthorized"
        with tensorbucket.Relay(server.address, "another", token, local=f"{down}o", timeout=2) as elsewhere:
            with pytest.raises(tensorbucket.ChannelError, match="serves channel") as missing:
                elsewhere.relay(10)
            assert missing.value.code == "ChannelMissing"
        server.close()
        serving.join(timeout=10)
    with pytest.raises(tensorbucket.InvalidArgument, match="idle_timeout"):
        tensorbucket.Relay("127.0.0.1:1", up, token, idle_timeout=0)
    with pytest.raises(tensorbucket.InvalidArgument, match="timeout must be seconds, at least 0"):
        tensorbucket.Relay("127.0.0.1:1", up, token, timeout=-1)


def serve_once(channel, token, preload=None):
    """A fresh Python process that publishes on `channel`, then serves it for a moment: what it
    printed (the UCX files in its memory before and once serving, one JSON line), its stdout and
    stderr, and its exit status. `preload`: a library the dynamic loader loads first."""
    script = f"""
import json, tensorbucket, torch
def ucx_files():
    with open("/proc/self/maps") as maps:
        return sorted({{line.split()[-1] for line in maps if "/libuc" in line}})
with tensorbucket.Publisher({channel!r}, min_consumers=0) as publisher:
    publisher.publish({{"w": torch.ones(4)}}, version=1)
    before = ucx_files()
    try:
        with tensorbucket.Server({channel!r}, "127.0.0.1:0", {str(token)!r}, timeout=10):
            print(json.dumps([before, ucx_files()]))
    except tensorbucket.NetworkError as e:
        print(json.dumps([before, str(e)]))
"""
    env = dict(os.environ)
    if preload is not None:  # after a sanitizer's runtime, which must come first
        env["LD_PRELOAD"] = " ".join(filter(None, [env.get("LD_PRELOAD"), str(preload)]))
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    return run


def test_ucx_is_loaded_only_once_the_network_is_used(tmp_path):
    """UCX patches the process's memory functions as it loads, 0.2-0.4 s on UCX 1.22
    (net/ucx.hpp): the module and tbucket load it when a server or a relay first needs it,
    and a process that only publishes never does."""
    run = serve_once(f"pyucx{os.getpid()}", make_token(tmp_path / "token"))
    assert run.returncode == 0, run.stderr
    before, serving = json.loads(run.stdout)
    assert before == []
    assert any(path.endswith("/libucp.so.0") for path in serving), serving
    assert any("/libucs" in path for path in serving), serving
    # The dynamic loader names every library it loads (LD_DEBUG=files): tbucket's own, not UCX.
    shown = subprocess.run([TBUCKET, "--help"], env={**os.environ, "LD_DEBUG": "files"}, capture_output=True,
                           text=True, timeout=60)
    assert shown.returncode == 0 and "libtensorbucket" in shown.stderr
    assert "libucp" not in shown.stderr and "libucs" not in shown.stderr


def test_a_ucx_already_in_the_process_is_the_one_used(tmp_path):
    """Another library's UCX (MPI's, a preload) is used as it is. Before, a second libucp loaded
    from the build's folder shared the first one's libucs, and the process crashed at exit."""
    token = make_token(tmp_path / "token")
    first = serve_once(f"pyucxa{os.getpid()}", token)
    assert first.returncode == 0, first.stderr
    ucp = next(Path(path) for path in json.loads(first.stdout)[1] if path.endswith("/libucp.so.0"))
    copy = tmp_path / "other-ucx"
    copy.mkdir()
    for library in ucp.parent.glob("libuc*.so*"):
        (copy / library.name).write_bytes(library.read_bytes())
    run = serve_once(f"pyucxb{os.getpid()}", token, preload=copy / "libucp.so.0")
    assert run.returncode == 0, run.stderr
    before, serving = json.loads(run.stdout)
    ucp_files = [path for path in serving if "/libucp" in path]
    assert ucp_files == [str(copy / "libucp.so.0")], serving


def test_an_older_ucx_in_the_process_is_refused_by_name(tmp_path):
    """UCX itself only warns when its API is older than the headers the module was built
    against; the network side refuses it, naming the file and both versions."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build an old libucp stand-in")
    source = tmp_path / "old_ucp.c"
    source.write_text("void ucp_get_version(unsigned *major, unsigned *minor, unsigned *release)\n"
                      "{ *major = 1; *minor = 9; *release = 0; }\n")
    old = tmp_path / "libucp.so.0"
    subprocess.run([compiler, "-shared", "-fPIC", "-Wl,-soname,libucp.so.0", "-o", str(old), str(source)],
                   check=True, timeout=60)
    run = serve_once(f"pyucxo{os.getpid()}", make_token(tmp_path / "token"), preload=old)
    assert run.returncode == 0, run.stderr
    before, error = json.loads(run.stdout)
    assert f"the UCX loaded ({old}) is version 1.9.0; this build needs 1." in error, error


def test_server_errors_name_what_is_wrong(tmp_path):
    token = make_token(tmp_path / "token")
    channel = f"pyerr{os.getpid()}"
    with pytest.raises(tensorbucket.ChannelError, match="no live producer") as missing:
        tensorbucket.Server(channel, "127.0.0.1:0", token, timeout=0.2)
    assert missing.value.code == "ChannelMissing"

    readable = make_token(tmp_path / "readable")
    readable.chmod(0o644)
    with pytest.raises(tensorbucket.ChannelError, match="readable") as denied:
        tensorbucket.Server(channel, "127.0.0.1:0", readable, timeout=0.2)
    assert denied.value.code == "PermissionDenied"
    with pytest.raises(tensorbucket.InvalidArgument, match="^token file '.*absent' does not exist$"):
        tensorbucket.Server(channel, "127.0.0.1:0", tmp_path / "absent", timeout=0.2)

    with tensorbucket.Publisher(channel, min_consumers=0):
        with pytest.raises(tensorbucket.InvalidArgument, match="port"):
            tensorbucket.Server(channel, "127.0.0.1", token)
        # Every interface only where 0.0.0.0 (or [::]) is named: inet_aton's shorthands and an
        # IPv4-mapped address would listen there too.
        for shorthand in ("0:0", "0.0:0", "127.1:0", "0x7f.0.0.1:0"):
            with pytest.raises(tensorbucket.InvalidArgument, match="not an IPv4 address in four decimal parts"):
                tensorbucket.Server(channel, shorthand, token)
        with pytest.raises(tensorbucket.InvalidArgument, match="IPv4-mapped"):
            tensorbucket.Server(channel, "[::ffff:0.0.0.0]:0", token)
        with pytest.raises(tensorbucket.NetworkError, match="192.0.2.1:0: not an address of this host") as unbound:
            tensorbucket.Server(channel, "192.0.2.1:0", token)  # TEST-NET-1: not this host's
        assert unbound.value.code == "NetworkError"
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            address = "127.0.0.1:%d" % taken.getsockname()[1]
            with pytest.raises(tensorbucket.NetworkError, match=f"{address}: the port is in use"):
                tensorbucket.Server(channel, address, token)
        with pytest.raises(tensorbucket.InvalidArgument, match="peer_timeout"):
            tensorbucket.Server(channel, "127.0.0.1:0", token, peer_timeout=0)
        with pytest.raises(tensorbucket.InvalidArgument, match="max_peers is at most 1024, not 1025"):
            tensorbucket.Server(channel, "127.0.0.1:0", token, max_peers=1025)
        with pytest.raises(tensorbucket.InvalidArgument, match="window"):
            tensorbucket.Server(channel, "127.0.0.1:0", token, window=0)
        with pytest.raises(TypeError, match="listen"):
            tensorbucket.Server(channel, 8080, token)  # type: ignore[arg-type]

        with tensorbucket.Server(channel, "127.0.0.1:0", token) as server:
            host, port = server.address.rsplit(":", 1)
            assert host == "127.0.0.1" and int(port) > 0
            started = time.monotonic()
            server.serve(0.3)  # no relay: nothing to do, and it returns on time
            assert 0.3 <= time.monotonic() - started < 5
            assert server.peers == 0 and server.buckets_served == 0


def test_max_peers_turns_a_relay_away_until_one_leaves(tmp_path, procs):
    """With --max-peers 1, a second relay is turned away, retries, and is admitted once the
    first one is gone; its servers then get every bucket from there on, in order."""
    token = make_token(tmp_path / "token")
    tag = os.getpid()
    up = f"mpup{tag}"
    address = f"127.0.0.1:{free_port()}"
    serve_log = open(tmp_path / "serve.log", "w")
    procs.append(subprocess.Popen([TBUCKET, "produce", "--channel", up, "--buckets", "100000", "--tensors", "4",
                                   "--tensor-bytes", "4096", "--quiet", "--timeout-ms", "60000", "--interval-ms", "5"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
    procs.append(subprocess.Popen([TBUCKET, "serve", "--channel", up, "--listen", address, "--token-file", str(token),
                                   "--max-peers", "1"], stdout=serve_log, stderr=subprocess.STDOUT))
    first = relay(procs, tmp_path, "first", address, up, f"mpone{tag}", token, "--consumers", "0")
    wait_for(lambda: "connected to" in (tmp_path / "first.log").read_text(), 30, "the first relay to connect")
    second = relay(procs, tmp_path, "second", address, up, f"mptwo{tag}", token)
    wait_for(lambda: "max_peers" in (tmp_path / "serve.log").read_text(), 30, "the second relay to be turned away")
    wait_for(lambda: (tmp_path / "second.log").read_text().count("max_peers (1) reached") >= 3, 30,
             "the second relay to say why, and retry")
    assert second.poll() is None  # turned away is not fatal: it retries
    # One line for its retries, however often it comes back within 30 s.
    assert (tmp_path / "serve.log").read_text().count(" away: ") == 1, (tmp_path / "serve.log").read_text()

    consumer_log = open(tmp_path / "consumer.log", "w")
    consumer = subprocess.Popen([TBUCKET, "consume", "--channel", f"mptwo{tag}", "--buckets", "20", "--verify",
                                 "--json", "--quiet", "--timeout-ms", "60000"], stdout=consumer_log,
                                stderr=subprocess.STDOUT)
    procs.append(consumer)
    time.sleep(1)
    first.send_signal(signal.SIGTERM)
    assert first.wait(timeout=15) == 128 + signal.SIGTERM
    assert consumer.wait(timeout=60) == 0, (tmp_path / "second.log").read_text()
    assert "the link ended" in (tmp_path / "serve.log").read_text()  # the first relay's leaving, as it is
    lines = [json.loads(line) for line in (tmp_path / "consumer.log").read_text().splitlines() if line.startswith("{")]
    assert len(lines) == 20 and all(line["ok"] for line in lines)
    versions = [line["version"] for line in lines]
    assert versions == sorted(versions) and len(set(versions)) == 20


def test_a_relay_whose_servers_stall_drops_the_link_and_resumes_at_the_next_update(tmp_path, procs):
    """The relay's local server stops (SIGSTOP) with the local slots full: the relay's local
    publish times out (--timeout-ms), it drops the link instead of holding the served channel,
    and once the server runs again it resumes with newer buckets, none torn or twice."""
    token = make_token(tmp_path / "token")
    tag = os.getpid()
    up, down = f"stup{tag}", f"stdown{tag}"
    address = f"127.0.0.1:{free_port()}"
    procs.append(subprocess.Popen([TBUCKET, "produce", "--channel", up, "--buckets", "100000", "--tensors", "4",
                                   "--tensor-bytes", "4096", "--quiet", "--timeout-ms", "60000", "--interval-ms", "5"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
    serve_log = open(tmp_path / "serve.log", "w")
    procs.append(subprocess.Popen([TBUCKET, "serve", "--channel", up, "--listen", address, "--token-file", str(token),
                                   "--peer-timeout-ms", "3000"], stdout=serve_log, stderr=subprocess.STDOUT))
    relay(procs, tmp_path, "relay", address, up, down, token, "--timeout-ms", "1000")
    consumer_log = open(tmp_path / "consumer.log", "w")
    consumer = subprocess.Popen([TBUCKET, "consume", "--channel", down, "--buckets", "60", "--verify", "--json",
                                 "--quiet", "--timeout-ms", "60000"], stdout=consumer_log, stderr=subprocess.STDOUT)
    procs.append(consumer)

    def received():  # complete lines only: the consumer flushes in blocks
        text = (tmp_path / "consumer.log").read_text()
        return [json.loads(line) for line in text[:text.rfind("\n") + 1].splitlines() if line.startswith("{")]

    wait_for(lambda: len(received()) >= 10, 60, "the first buckets through the relay")
    consumer.send_signal(signal.SIGSTOP)
    try:
        wait_for(lambda: "no local slot came free" in (tmp_path / "relay.log").read_text(), 30,
                 "the relay to give up on its stalled server")
        time.sleep(1)
    finally:
        consumer.send_signal(signal.SIGCONT)
    assert consumer.wait(timeout=60) == 0, (tmp_path / "relay.log").read_text()
    lines = received()
    assert len(lines) == 60 and all(line["ok"] for line in lines)
    versions = [line["version"] for line in lines]
    assert all(a < b for a, b in zip(versions, versions[1:])), versions
    assert versions[-1] - versions[0] > 59, "no bucket was skipped while the server was stopped"
    assert (tmp_path / "relay.log").read_text().count("connected to") >= 2  # and connected again


def test_a_stalled_relay_holds_back_only_itself(tmp_path, procs):
    """Two relays take chunked payloads (12 MiB: more chunks than are sent ahead, received
    straight into a local slot). One's
    local server stops with its slots full, so that relay stops asking for chunks. The other
    keeps its link for longer than its idle timeout (no reconnect), and its server gets every
    bucket in order; the stalled one is dropped after --peer-timeout-ms."""
    token = make_token(tmp_path / "token")
    tag = os.getpid()
    up = f"slup{tag}"
    address = f"127.0.0.1:{free_port()}"
    procs.append(subprocess.Popen([TBUCKET, "produce", "--channel", up, "--buckets", "100000", "--tensors", "12",
                                   "--tensor-bytes", str(1 << 20), "--quiet", "--timeout-ms", "60000",
                                   "--interval-ms", "20"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
    serve_log = open(tmp_path / "serve.log", "w")
    procs.append(subprocess.Popen([TBUCKET, "serve", "--channel", up, "--listen", address, "--token-file", str(token),
                                   "--peer-timeout-ms", "3000"], stdout=serve_log, stderr=subprocess.STDOUT))
    relay(procs, tmp_path, "steady", address, up, f"slsteady{tag}", token, "--idle-timeout-ms", "2000")
    relay(procs, tmp_path, "stalled", address, up, f"slstalled{tag}", token, "--timeout-ms", "8000")
    logs = {name: open(tmp_path / f"{name}.log", "w") for name in ("steady_server", "stalled_server")}
    stalled = subprocess.Popen([TBUCKET, "consume", "--channel", f"slstalled{tag}", "--buckets", "100000",
                                "--quiet", "--timeout-ms", "60000"], stdout=logs["stalled_server"],
                               stderr=subprocess.STDOUT)
    procs.append(stalled)
    wait_for(lambda: "connected to" in (tmp_path / "stalled.log").read_text(), 30, "the stalled relay to connect")
    time.sleep(1)
    stalled.send_signal(signal.SIGSTOP)
    try:
        steady = subprocess.Popen([TBUCKET, "consume", "--channel", f"slsteady{tag}", "--buckets", "60", "--verify",
                                   "--json", "--quiet", "--timeout-ms", "60000"], stdout=logs["steady_server"],
                                  stderr=subprocess.STDOUT)
        procs.append(steady)
        assert steady.wait(timeout=90) == 0, (tmp_path / "steady.log").read_text()
        wait_for(lambda: "took no bucket within" in (tmp_path / "serve.log").read_text(), 30,
                 "the stalled relay to be dropped")
    finally:
        stalled.send_signal(signal.SIGCONT)
    lines = [json.loads(line) for line in (tmp_path / "steady_server.log").read_text().splitlines()
             if line.startswith("{")]
    assert len(lines) == 60 and all(line["ok"] for line in lines)
    versions = [line["version"] for line in lines]
    assert all(a < b for a, b in zip(versions, versions[1:])), versions
    assert (tmp_path / "steady.log").read_text().count("connected to") == 1, (tmp_path / "steady.log").read_text()


def test_a_bucket_that_fails_its_checks_is_skipped_and_serving_goes_on(tmp_path, procs):
    """A payload byte changed in its slot after the producer published it under its checksum:
    `tbucket serve` skips that bucket with a line saying why, and goes on serving the next."""
    token = make_token(tmp_path / "token")
    tag = os.getpid()
    up, down = f"badup{tag}", f"baddown{tag}"
    address = f"127.0.0.1:{free_port()}"
    with tensorbucket.Publisher(up, slots=2, checksum=True) as publisher:
        publisher.publish({"w": torch.full((1024,), 1.5)}, version=1, timeout=10)
        pattern = torch.full((1024,), 1.5).numpy().tobytes()
        damaged = 0
        for slot in Path("/dev/shm").glob(f"tensorbucket.{up}.slot*"):
            with open(slot, "r+b") as f:
                data = f.read()
                at = data.find(pattern)
                if at >= 0:
                    f.seek(at + 100)
                    f.write(b"\x01")
                    damaged += 1
        assert damaged == 1, "the slot holding version 1"
        publisher.publish({"w": torch.full((1024,), 2.5)}, version=2, timeout=10)
        serve_log = open(tmp_path / "serve.log", "w")
        serve = subprocess.Popen([TBUCKET, "serve", "--channel", up, "--listen", address, "--token-file", str(token)],
                                 stdout=serve_log, stderr=subprocess.STDOUT)
        procs.append(serve)
        relay(procs, tmp_path, "relay", address, up, down, token)
        with tensorbucket.Subscriber(down, timeout=30) as subscriber:
            bucket = subscriber.next(timeout=30)
            assert bucket is not None, (tmp_path / "relay.log").read_text()
            assert bucket.version == 2 and torch.equal(bucket["w"], torch.full((1024,), 2.5))
            bucket.release()
        log = (tmp_path / "serve.log").read_text()
        assert "skipped a bucket of the channel that failed its checks: ChecksumMismatch" in log, log
        assert serve.poll() is None, log


def test_a_forked_child_leaves_the_server_to_its_parent(tmp_path, procs):
    """A child forked from a serving process, which closes what it inherited (as a worker
    process might): serve() there refuses, close() lets go without touching the links it shares
    with the parent, and the parent goes on serving the same relay, with no reconnect."""
    token = make_token(tmp_path / "token")
    tag = os.getpid()
    up, down = f"forkup{tag}", f"forkdown{tag}"
    with tensorbucket.Publisher(up, slots=2) as publisher, \
            tensorbucket.Server(up, f"127.0.0.1:{free_port()}", token, timeout=30) as server:
        relay(procs, tmp_path, "relay", server.address, up, down, token)
        with tensorbucket.Subscriber(down, timeout=30) as subscriber:

            def through(version):  # serve in slices, on this thread, until the relay's consumer has it
                publisher.publish(weights(version), version=version, timeout=30)
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    server.serve(0.05)
                    bucket = subscriber.next(timeout=0)
                    if bucket is not None:
                        assert bucket.version == version and torch.equal(bucket["scale"], weights(version)["scale"])
                        bucket.release()
                        return
                pytest.fail(f"version {version} did not come through: {(tmp_path / 'relay.log').read_text()}")

            through(0)
            child = os.fork()
            if child == 0:  # no pytest here: the exit status says how it went
                status = 1
                try:
                    server.serve(0.1)
                except tensorbucket.InvalidArgument as e:
                    status = 0 if "forked" in str(e) else 2
                server.close()
                os._exit(status)
            assert os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]) == 0
            for version in range(1, 6):
                through(version)
            log = (tmp_path / "relay.log").read_text()  # before the server closes
            assert log.count("connected to") == 1 and "reconnecting" not in log, log


def test_a_restarted_python_server_listens_again_on_its_port_at_once(tmp_path, procs):
    """A trainer's server killed while a relay is connected leaves the port's connections in
    TIME_WAIT for a minute; the trainer restarted binds the same port at once and serves the
    relay again."""
    token = make_token(tmp_path / "token")
    tag = os.getpid()
    up, down = f"reup{tag}", f"redown{tag}"
    address = f"127.0.0.1:{free_port()}"
    procs.append(subprocess.Popen([TBUCKET, "produce", "--channel", up, "--buckets", "100000", "--tensors", "4",
                                   "--tensor-bytes", "4096", "--quiet", "--timeout-ms", "60000", "--interval-ms", "5"]))
    serve = f"import tensorbucket as tb; tb.Server({up!r}, {address!r}, {str(token)!r}, timeout=30).serve()"
    first = subprocess.Popen([sys.executable, "-c", serve], stderr=subprocess.PIPE, text=True)
    procs.append(first)
    relay(procs, tmp_path, "relay", address, up, down, token, "--consumers", "0")
    wait_for(lambda: "connected to" in (tmp_path / "relay.log").read_text(), 30, "the relay to connect")
    first.kill()
    first.wait()
    second = subprocess.Popen([sys.executable, "-c", serve], stderr=subprocess.PIPE, text=True)
    procs.append(second)
    wait_for(lambda: (tmp_path / "relay.log").read_text().count("connected to") >= 2 or second.poll() is not None,
             30, "the relay to connect to the restarted server")
    assert second.poll() is None, second.stderr.read()


def test_serve_with_a_duration_returns_at_it_while_another_thread_serves(tmp_path):
    token = make_token(tmp_path / "token")
    channel = f"pyturn{os.getpid()}"
    with tensorbucket.Publisher(channel, min_consumers=0):
        with tensorbucket.Server(channel, "127.0.0.1:0", token) as server:
            serving = threading.Thread(target=server.serve)  # without end, until close()
            serving.start()
            time.sleep(0.5)  # it has the turn
            start = time.monotonic()
            timed = threading.Thread(target=server.serve, args=(0.5,))  # waits for the turn: counted
            timed.start()
            timed.join(timeout=5)
            returned, waited = not timed.is_alive(), time.monotonic() - start
            server.close()
            serving.join(timeout=10)
            timed.join(timeout=10)
            assert returned and 0.4 < waited < 3, waited
            assert not serving.is_alive()
