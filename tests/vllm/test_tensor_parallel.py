"""Two tensor-parallel workers of one engine on one channel: each takes every bucket (fan-out,
no copy on the trainer's side) and loads its own shard of it."""
import contextlib
import os

import pytest
import torch
from conftest import engine_args, generate, llama, reference, same_generation

from tensorbucket.vllm import LLMClient, TrainerEngine, TrainerInitInfo

from vllm.distributed.weight_transfer.base import ModuleSource


@pytest.fixture(scope="module")
def llm(model_dir):
    from vllm import LLM

    # vLLM's CPU backend binds each worker to a NUMA node of its own unless told not to bind.
    patch = pytest.MonkeyPatch()
    patch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    before = set(os.listdir("/dev/shm"))
    engine = LLM(**engine_args(model_dir), tensor_parallel_size=2)
    yield engine
    engine.llm_engine.engine_core.shutdown()
    patch.undo()
    # vLLM's CPU all-reduce maps a shared-memory segment per worker, which a worker stopped by
    # shutdown() sometimes leaves behind: those this engine made go with it.
    for name in set(os.listdir("/dev/shm")) - before:
        if name.startswith("vllm_dist_") and "-cpushm" in name:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join("/dev/shm", name))


def test_two_workers_load_every_update_from_one_channel(llm):
    model = llama(21)
    # Small buckets through two slots: the update streams, each bucket released by both workers.
    engine = TrainerEngine.trainer_init(TrainerInitInfo(rank=0, channel="tbvllm-tp2", slots=2,
                                                        bucket_bytes=256 << 10),
                                        client=LLMClient(llm), source=ModuleSource(model))
    for _ in range(3):
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(torch.randn_like(parameter) * 0.05)
        engine.send_weights()
        same_generation(generate(llm), reference(model))
    engine.shutdown()
