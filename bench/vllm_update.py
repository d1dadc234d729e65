"""A whole weight update into a running vLLM engine through the tensorbucket backend, beside
the floor and what vLLM users do on CPU today, in the same run.

  VLLM_ALLOW_INSECURE_SERIALIZATION=1 .venv-vllm/bin/python bench/vllm_update.py [--rounds N] [--leak-updates N]

(after scripts/install-deps --vllm and the package pip-installed there, as scripts/test does;
the insecure flag is the baselines': they ship callables and tensors through vLLM's pickled
collective_rpc, which tensorbucket never needs). Two models, each an offline vllm.LLM on CPU in
fp32, its engine core and worker in processes of their own:

- tiny: the suite's Llama (2 layers, hidden 128), ~1.3 MB;
- 500 MB: a wider Llama (9 layers, hidden 1024, intermediate 2816, vocab 8192), ~520 MB.

Each figure is a wall time in the trainer's process; rounds of the first two interleave, the
third's rounds come after them (its gigabytes of pickles slowed whatever ran next):

- tensorbucket: TrainerEngine.send_weights(), start to finish_weight_update returned (the
  update published in buckets of 256 MiB, taken whole, loaded inside vLLM's layerwise reload);
- floor: one collective_rpc whose worker-side function runs vLLM's layerwise reload of the same
  tensors already in the worker's memory: initialize, load_weights, finalize (what no transport
  can beat); its in-worker time beside it;
- collective_rpc: one collective_rpc carrying the tensors as an argument (pickled: vLLM's
  message queue turns bare tensors into lists) to a function that runs the same reload, the
  pickling in the timing: what vLLM users do on CPU today.

Medians over the rounds; the load average before and after says whether the machine was quiet.
Then --leak-updates updates of the 500 MB model in a row, the trainer's RSS and its channel's
bytes in /dev/shm sampled along the way: the trainer's extra memory is its slots, flat.
"""
import argparse
import os
import pickle
import statistics
import sys
import tempfile
import time

import psutil
import torch
from transformers import LlamaConfig, LlamaForCausalLM

MiB = 1 << 20


def llama(seed, **shape):
    torch.manual_seed(seed)
    config = LlamaConfig(tie_word_embeddings=False, max_position_embeddings=256, **shape)
    return LlamaForCausalLM(config).float().eval()


MODELS = {
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512),
    "500 MB": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=9, num_attention_heads=8,
                   num_key_value_heads=8, vocab_size=8192),
}


# -- What the worker runs for the two baselines (shipped by collective_rpc: its first argument
# is the worker).

def _reload(worker, tensors):
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    model = worker.model_runner.get_model()
    start = time.perf_counter()
    initialize_layerwise_reload(model)
    model.load_weights(iter(tensors.items()))
    finalize_layerwise_reload(model, worker.model_runner.model_config)
    return time.perf_counter() - start


def keep_tensors(worker, shapes):
    """The floor's tensors, made once in the worker's memory."""
    torch.manual_seed(1)
    worker._bench_tensors = {name: torch.randn(shape, dtype=dtype) for name, (dtype, shape) in shapes.items()}


def reload_kept(worker):
    return _reload(worker, worker._bench_tensors)


def reload_given(worker, pickled):
    # vLLM's message queue turns bare tensors in arguments into lists: they travel pickled.
    return _reload(worker, pickle.loads(pickled))


def shm_bytes(channel):
    return sum(os.stat(f"/dev/shm/{name}").st_size for name in os.listdir("/dev/shm") if name.startswith(f"tensorbucket.{channel}"))


def median_ms(values):
    return f"{statistics.median(values) * 1e3:9.1f} ms"


def rounds_ms(values):
    return "rounds: " + " ".join(f"{value * 1e3:.0f}" for value in values)


def run(name, shape, rounds, leak_updates):
    from vllm import LLM
    from vllm.distributed.weight_transfer.base import ModuleSource

    from tensorbucket.vllm import LLMClient, TrainerEngine, TrainerInitInfo

    folder = tempfile.mkdtemp(prefix="vllm-update-")
    llama(0, **shape).save_pretrained(folder)
    trained = llama(1, **shape)
    megabytes = sum(t.numel() * t.element_size() for t in trained.state_dict().values()) / 1e6
    llm = LLM(model=folder, skip_tokenizer_init=True, enforce_eager=True, dtype="float32", max_model_len=128,
              max_num_seqs=4, kv_cache_memory_bytes=64 << 20, weight_transfer_config={"backend": "tensorbucket"})
    channel = f"vllm-bench-{os.getpid()}"
    engine = TrainerEngine.trainer_init(TrainerInitInfo(rank=0, channel=channel), client=LLMClient(llm),
                                        source=ModuleSource(trained))
    state = {key: value.detach() for key, value in trained.state_dict().items()}
    llm.collective_rpc(keep_tensors, args=({k: (v.dtype, tuple(v.shape)) for k, v in state.items()},))
    ours, floor, floor_inside, pickled = [], [], [], []
    for _ in range(2):  # warm: the slots sized and first touched, the worker's mappings made
        engine.send_weights()
    for _ in range(rounds):
        start = time.perf_counter()
        engine.send_weights()
        ours.append(time.perf_counter() - start)
        start = time.perf_counter()
        floor_inside.append(llm.collective_rpc(reload_kept)[0])
        floor.append(time.perf_counter() - start)
    # After the others: its gigabytes of pickles churn both processes' memory, which slowed the
    # next rounds of the others by up to 2x when it ran between them.
    for _ in range(rounds):
        start = time.perf_counter()
        llm.collective_rpc(reload_given, args=(pickle.dumps(state),))
        pickled.append(time.perf_counter() - start)
    print(f"\n{name} model, {megabytes:.1f} MB in {len(state)} tensors, {rounds} rounds (medians)")
    print(f"  tensorbucket send_weights()      {median_ms(ours)}  ({len(engine._publisher.plan)} bucket(s)); "
          f"{rounds_ms(ours)}")
    print(f"  floor: reload of kept tensors    {median_ms(floor)}  (in the worker: {median_ms(floor_inside).strip()}); "
          f"{rounds_ms(floor)}")
    print(f"  collective_rpc with the tensors  {median_ms(pickled)}; {rounds_ms(pickled)}")
    print(f"  tensorbucket / floor: {statistics.median(ours) / statistics.median(floor):.2f}x; "
          f"/ in-worker floor: {statistics.median(ours) / statistics.median(floor_inside):.2f}x; "
          f"/ collective_rpc: {statistics.median(ours) / statistics.median(pickled):.2f}x")
    if leak_updates:
        me = psutil.Process()
        samples = []
        for update in range(1, leak_updates + 1):
            engine.send_weights()
            if update in (1, 10, leak_updates // 2, leak_updates):
                samples.append((update, me.memory_info().rss / MiB, shm_bytes(channel) / MiB))
        print(f"  {leak_updates} updates in a row: trainer RSS and its channel in /dev/shm")
        for update, rss, shm in samples:
            print(f"    after update {update:4d}: RSS {rss:8.1f} MiB, /dev/shm {shm:8.1f} MiB")
    engine.shutdown()
    llm.llm_engine.engine_core.shutdown()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--leak-updates", type=int, default=100)
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION") != "1":
        sys.exit("the baselines ship callables through collective_rpc: set VLLM_ALLOW_INSECURE_SERIALIZATION=1")
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for name in args.models:
        run(name, MODELS[name], args.rounds, args.leak_updates if name == "500 MB" else 0)
    print(f"\nload average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
