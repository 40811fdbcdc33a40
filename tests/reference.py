"""References no one here wrote: transformers' own models and generate, for tests to
compare against."""
from __future__ import annotations

import torch
from transformers import GenerationMixin, PreTrainedModel


def transformers_gguf_model(source) -> PreTrainedModel:
    """What from_pretrained(folder, gguf_file=...) builds (same config parsing, same GGUF tensor
    processor, including its q/k reverse permutation), with the tied LM head actually tied:
    from_pretrained leaves SmolLM2's lm_head randomly initialised from a GGUF file (and needs
    accelerate)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(source.folder, gguf_file=source.gguf_file)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    parsed = load_gguf_checkpoint(source.folder / source.gguf_file, return_tensors=True,
                                  model_to_load=hf)
    missing, unexpected = hf.load_state_dict(parsed["tensors"], strict=False)
    assert missing == ["lm_head.weight"] and not unexpected  # tied: the head is the embedding
    hf.tie_weights()
    return hf


def hf_greedy(model: PreTrainedModel, prompts: list[list[int]],
              max_new_tokens: int) -> list[list[int]]:
    """transformers generate, one prompt at a time so that no padding can change its result. EOS is
    switched off, not suppressed, to match ignore_eos: the EOS token may be generated and decoding
    goes on (min_new_tokens would instead forbid EOS and change the tokens)."""
    # a causal LM: transformers 5 mixes generate in per class
    assert isinstance(model, GenerationMixin)
    model.generation_config.eos_token_id = None
    outs = []
    for ids in prompts:
        x = torch.tensor([ids])
        y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                           do_sample=False, pad_token_id=0)
        assert y.shape[1] == len(ids) + max_new_tokens
        outs.append(y[0, len(ids):].tolist())
    return outs


def hf_folder_model(folder) -> PreTrainedModel:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
