"""Build a tiny random-weight Llama-style model folder for tests and demos; nothing is downloaded.

    python scripts/make_tiny_model.py [OUTPUT_DIR]      # default: models/tiny-llama
    python scripts/make_tiny_model.py OUT --layers 8 --heads 8 --kv-heads 8 --hidden 256   # more KV per token

The tokenizer is a byte-level BPE (vocab ~400) trained with `tokenizers` on a fixed built-in corpus and wrapped
in `transformers.PreTrainedTokenizerFast`; the model is a 2-layer `LlamaForCausalLM` (hidden 128, 2 heads of
64) with large random weights (`initializer_range` 0.5), so its greedy output depends on the whole KV cache and
an equality test between a disaggregated and a plain engine means something. The result is deterministic:
the same seed gives the same files. `--layers`, `--heads`, `--kv-heads`, `--hidden` and `--intermediate` make it
bigger: KV per token is 2 x layers x kv-heads x 64 x 4 bytes (float32), so a benchmark over a real link
(benchmarks/bench_link.py) can make the KV WRITE as long as the compute.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DEFAULT_OUTPUT = Path("models/tiny-llama")

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Disaggregated serving splits prefill and decode across engines.",
    "A rendezvous service tells each engine when and where to move KV-cache blocks.",
    "Pack my box with five dozen liquor jugs; sphinx of black quartz, judge my vow!",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 100 1000 3.14159",
    "In the beginning the universe was created. This has made a lot of people very angry.",
    "def main(argv=None):\n    return 0\n\nif __name__ == '__main__':\n    main()\n",
    "Once upon a time, in a land far away, there lived a small model with random weights.",
    "Hello, world! How are you today? I am fine, thank you, and you?",
    '{"key": [1, 2, 3], "nested": {"a": true, "b": null}}',
]

_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def build(
    output: Path,
    *,
    seed: int = 0,
    vocab_size: int = 400,
    initializer_range: float = 0.5,
    layers: int = 2,
    heads: int = 2,
    kv_heads: int = 2,
    hidden: int = 128,
    intermediate: int = 256,
) -> Path:
    """Write the tokenizer, config and weights into `output`; return it. Attention heads are 64 wide."""
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    output.mkdir(parents=True, exist_ok=True)

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>", "<unk>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )
    fast.chat_template = _CHAT_TEMPLATE
    fast.save_pretrained(output)

    config = LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=64,
        max_position_embeddings=1024,
        initializer_range=initializer_range,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)  # type: ignore[no-untyped-call]
    model.save_pretrained(output, safe_serialization=True)
    return output


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", nargs="?", type=Path, default=DEFAULT_OUTPUT, help=f"default: {DEFAULT_OUTPUT}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=400)
    parser.add_argument("--initializer-range", type=float, default=0.5)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=2, help="attention heads (64 wide)")
    parser.add_argument("--kv-heads", type=int, default=2, help="key/value heads (divides --heads)")
    parser.add_argument("--hidden", type=int, default=128, help="hidden size")
    parser.add_argument("--intermediate", type=int, default=256, help="MLP intermediate size")
    args = parser.parse_args(argv)
    shape = {k: getattr(args, k) for k in ("layers", "heads", "kv_heads", "hidden", "intermediate")}
    path = build(
        args.output, seed=args.seed, vocab_size=args.vocab_size, initializer_range=args.initializer_range, **shape
    )
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
