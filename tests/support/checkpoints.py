"""A local Hugging Face checkpoint for tests: a tiny random Llama and its tokenizer, on disk.

`write_checkpoint(path)` writes config.json, tokenizer.json, tokenizer_config.json (with a chat
template) and model.safetensors into `path`: what the checkpoint tests load and the server tests
serve (through the `checkpoint` fixture of tests/examples/conftest.py, one per test module).
"""

from __future__ import annotations

import json
from pathlib import Path

from examples.models import Llama

CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n"
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
CORPUS = ["the quick brown fox jumps over the lazy dog", "paged attention keeps blocks",
          "hello world, hello graphs", "<|user|> <|assistant|> <|system|>"] * 20


def write_checkpoint(path: Path, chat_template: str | None = CHAT_TEMPLATE, seed: int = 3
                     ) -> Path:
    """A tiny Llama with random weights and a byte-level BPE tokenizer trained on `CORPUS`."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bos, eos = tokenizer.token_to_id("<s>"), tokenizer.token_to_id("</s>")
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                             special_tokens=[("<s>", bos)])
    tokenizer.save(str(path / "tokenizer.json"))
    config = {**Llama.presets["tiny"], "vocab_size": tokenizer.get_vocab_size(),
              "architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "bos_token_id": bos, "eos_token_id": eos, "torch_dtype": "float32"}
    (path / "config.json").write_text(json.dumps(config))
    tokenizer_config = {"bos_token": "<s>", "eos_token": {"content": "</s>"}}
    if chat_template is not None:
        tokenizer_config["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    model = Llama.from_hf(config, seed=seed)
    save_file(model.hf_state_dict(),
              str(path / "model.safetensors"))
    return path
