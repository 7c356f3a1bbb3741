#!/usr/bin/env python3
"""Golden fixture for xinfer's tokenizer: a small byte-level BPE tokenizer.json built with Hugging Face
`tokenizers` in the Qwen2/Qwen3/MiMo layout (NFC normalizer, the Qwen2 split regex, byte-level
alphabet, special and added tokens), and the ids `tokenizers` encodes a set of tricky strings to.

    python3 scripts/gen_tokenizer_fixture.py tests/fixtures/tokenizer_bpe

Runs where `tokenizers` is installed (the GPU machine's python3). No download: the vocabulary is
trained here on the corpus below.
"""
import json
import os
import sys

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

# Qwen2's pre-tokenizer pattern (tokenizer.json of Qwen2/Qwen3/MiMo-V2-Flash).
PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")

CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's 2026 and we're serving models at 4,096 tokens.",
    "def main():\n    print(\"hello, world\")  # a comment\n    return 0\n\n",
    '{"name": "xinfer", "version": 1, "tags": ["moe", "swa"], "ok": true}',
    "Caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u2014 \u00fcber Stra\u00dfe, \u00e7a va?",
    "\u4e2d\u6587\u5206\u8bcd\u6d4b\u8bd5\uff0c\u65e5\u672c\u8a9e\u3082\u5c11\u3057\u3002\ud55c\uad6d\uc5b4",
    "Emoji: \U0001F600 \U0001F680 \u2764\ufe0f and math: x\u00b2 + y\u00b2 = z\u00b2, \u03c0 \u2248 3.14159",
    "I'll say they've been there, she'd know, you're right, I'm sure, he's it. DON'T SHOUT!",
    "tabs\tand   spaces    and\r\nwindows lines\n\n\nand trailing   ",
]

CASES = [
    "Hello world",
    "  leading spaces and trailing  ",
    "It's 2026: we're at 4,096 tokens; I'LL count 1234567890.",
    "def f(x):\n\treturn x**2  # square\n\n\n",
    "Caf\u00e9 vs Cafe\u0301 (NFC makes these the same)",
    "\u4e2d\u6587\u5206\u8bcd\u6d4b\u8bd5\uff0c\u65e5\u672c\u8a9e",
    "\U0001F600\U0001F680 \u2764\ufe0f!!",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n<think>\nok</think>",
    "a<|endoftext|>b <|endoftext|> c",
    "   \n  \r\n\t x  ",
    "unknown symbols \u2603 \u0916\u0940 \u05e9\u05dc\u05d5\u05dd",
    "",
]


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/tokenizer_bpe"
    os.makedirs(out, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=700, show_progress=False,
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 20, trainer)
    tok.add_tokens(["<think>", "</think>"])  # added, not special: decoded text keeps them
    tok.save(os.path.join(out, "tokenizer.json"))

    cases = []
    for text in CASES:
        ids = tok.encode(text).ids
        cases.append({"text": text, "ids": ids,
                      "decoded": tok.decode(ids, skip_special_tokens=True)})
    with open(os.path.join(out, "cases.json"), "w", encoding="utf-8") as f:
        json.dump({"generator": "scripts/gen_tokenizer_fixture.py", "cases": cases}, f, ensure_ascii=False, indent=1)
    print(f"wrote {out}: vocab {tok.get_vocab_size()}, {len(cases)} cases")


if __name__ == "__main__":
    main()
