"""Tokenizer parity test data: a byte-level BPE trained here on a small mixed corpus, written
both as a Hugging Face tokenizer.json and as a Kimi-style tiktoken.model (+ tokenizer_config.json
with the special tokens in added_tokens_decoder), and the reference ids of every corpus line
from the reference libraries (Python `tokenizers` and `tiktoken`, the latter with Kimi's
pre-tokenizer pattern).

    pip install tokenizers tiktoken
    python3 make_tokenizers.py     # writes hf/, tiktoken/ and references.json here
"""
import base64
import json
import os

import tiktoken
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

HERE = os.path.dirname(os.path.abspath(__file__))

KIMI_PAT = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])

SPECIALS = ["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>",
            "<think>", "</think>"]

TRAIN = [
    "The capital of France is Paris. The largest planet in our solar system is Jupiter.",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < 10; i++) { printf(\"%d\\n\", i); }",
    "Zürich, Köln, São Paulo, Kraków, naïve café, déjà vu, Ångström.",
    "東京は日本の首都です。北京是中国的首都。서울은 한국의 수도입니다.",
    "Numbers: 3.14159, 2718281828, 1,000,000 and 42 and 007.",
    "Emoji: 😀🎉👍🏽 and symbols ∑∫√≈≠ and arrows →⇒.",
    "Whitespace   runs\t\ttabs\n\n\nnew lines    and trailing   ",
    "I'm sure they'll say we've done what you'd LIKE; IT'S FINE, it's fine.",
] * 20

CORPUS = [
    "Hello, world!",
    "  leading spaces and trailing   ",
    "\t\tTabs\tand\nnew\r\nlines\n\n",
    "Zürich café — naïve Ångström",
    "東京タワーと北京烤鸭、서울 김치",
    "😀🎉👍🏽 emoji sequence 👨‍👩‍👧",
    "1234567890 3.14159 -42 1e-10 0x1F",
    "def f(x):\n    return x ** 2  # square\n",
    "if (a && b || !c) { return a[i] <= b->c; }",
    "It's I'M they'll WE'VE you'd",
    "[BOS]<|im_user|>user<|im_middle|>What is 2+2?<|im_end|><|im_assistant|>assistant<|im_middle|><think>",
    "mixed中文English123数字",
    "     ",
    "",
    "a" * 300,
    "\u00a0non\u2009breaking\u3000spaces",
    "<think>reasoning</think>answer[EOS]",
]


def main():
    # Byte-level BPE over the corpus (all 256 bytes in the alphabet, as tiktoken needs).
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=700, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[])
    tok.train_from_iterator(TRAIN, trainer)
    n = tok.get_vocab_size()
    tok.add_special_tokens(SPECIALS)
    os.makedirs(os.path.join(HERE, "hf"), exist_ok=True)
    tok.save(os.path.join(HERE, "hf", "tokenizer.json"))

    # The same vocabulary as tiktoken ranks: byte-level strings back to bytes, rank = id
    # (merged tokens got their ids in merge order).
    byte_decoder = {c: b for b, c in bytes_to_unicode().items()}
    vocab = {t: i for t, i in tok.get_vocab(with_added_tokens=False).items()}
    ranks = {bytes(byte_decoder[c] for c in t): i for t, i in vocab.items()}
    os.makedirs(os.path.join(HERE, "tiktoken"), exist_ok=True)
    with open(os.path.join(HERE, "tiktoken", "tiktoken.model"), "w") as f:
        for b, r in sorted(ranks.items(), key=lambda x: x[1]):
            f.write(base64.b64encode(b).decode() + " " + str(r) + "\n")
    specials = {s: n + i for i, s in enumerate(SPECIALS)}
    with open(os.path.join(HERE, "tiktoken", "tokenizer_config.json"), "w") as f:
        json.dump({"added_tokens_decoder": {str(i): {"content": s, "special": True} for s, i in specials.items()},
                   "bos_token": "[BOS]", "eos_token": "[EOS]"}, f, ensure_ascii=False, indent=1)
    enc = tiktoken.Encoding(name="kimi-test", pat_str=KIMI_PAT, mergeable_ranks=ranks, special_tokens=specials)

    refs = []
    for line in CORPUS:
        refs.append({
            "text": line,
            "hf_ids": tok.encode(line, add_special_tokens=False).ids,
            "tiktoken_ids": enc.encode(line, allowed_special="all"),
            "tiktoken_ordinary_ids": enc.encode_ordinary(line),
        })
    with open(os.path.join(HERE, "references.json"), "w") as f:
        json.dump({"made_with": {"tokenizers": __import__("tokenizers").__version__,
                                 "tiktoken": tiktoken.__version__},
                   "cases": refs}, f, ensure_ascii=False, indent=1)
    print(f"vocab {n} + {len(SPECIALS)} specials, {len(refs)} reference lines")


def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


if __name__ == "__main__":
    main()
