"""Word-level language-model data in the PTB text format: `ptb` (files) and `embedded_text`.

The PTB format (Mikolov's `simple-examples/data/ptb.{train,valid,test}.txt`): one sentence per
line, tokens separated by spaces, rare words already replaced by `<unk>`, numbers by `N`. As
the standard reader does, every line end becomes an `<eos>` token. The vocabulary comes from
the training file only, most frequent first (ties alphabetically), capped at
`dataset.vocab_size` with everything else mapped to `<unk>`. The token stream is then cut into
consecutive sequences of `dataset.seq_len` tokens; the target of each token is the next one.

`embedded_text` is real English prose that ships with every Python install: the standard
library's `pydoc_data.topics` (the language reference's help texts, ~65k words). Its prose
paragraphs are rendered into the same format (lowercase words, numbers as N, one sentence per
line; code samples and grammar rules dropped) and split deterministically into train, valid and
test, so that it runs through the very code that reads PTB. Its exact text follows the Python
version.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from typing import Sequence

import numpy as np

from tfkv.data.base import DataSet
from tfkv.errors import ConfigError, DataError

EOS, UNK = "<eos>", "<unk>"
SPLITS = ("train", "valid", "test")
FILES = {split: f"ptb.{split}.txt" for split in SPLITS}


# -- the PTB reader ---------------------------------------------------------------------------

def read_tokens(lines: Sequence[str]) -> list[str]:
    """Tokens of PTB-format lines, `<eos>` after each line (as the reference reader)."""
    out: list[str] = []
    for line in lines:
        out += line.split()
        out.append(EOS)
    return out


def build_vocab(tokens: Sequence[str], cap: int = 0) -> list[str]:
    """Words by falling frequency (ties alphabetically), at most `cap` (0: all) including
    `<unk>`, which is always present: held-out text has words the training text lacks."""
    counts = Counter(tokens)
    counts.pop(UNK, None)
    words = sorted(counts, key=lambda w: (-counts[w], w))
    if cap:
        words = words[: cap - 1]
    return words + [UNK]


def encode(tokens: Sequence[str], vocab: Sequence[str]) -> np.ndarray:
    index = {w: i for i, w in enumerate(vocab)}
    unk = index[UNK]
    return np.fromiter((index.get(t, unk) for t in tokens), dtype=np.int32, count=len(tokens))


def batchify(ids: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Consecutive (n, seq_len) inputs and targets shifted by one token; the tail is dropped."""
    n = (len(ids) - 1) // seq_len
    x = ids[: n * seq_len].reshape(n, seq_len)
    y = ids[1: n * seq_len + 1].reshape(n, seq_len)
    return x, y


def from_splits(name: str, texts: dict[str, list[str]], seq_len: int, vocab_size: int, eval_split: str) -> DataSet:
    """A DataSet from PTB-format lines per split: x, y are (n, seq_len) int32 token ids."""
    seq_len, cap = int(seq_len), int(vocab_size)
    split = str(eval_split)
    if seq_len < 1:
        raise ConfigError(f"dataset.seq_len={seq_len} must be at least 1")
    if cap == 1 or cap < 0:
        raise ConfigError(f"dataset.vocab_size={cap} must be 0 (no cap) or at least 2")
    if split not in ("valid", "test"):
        raise ConfigError(f"dataset.eval_split={split!r} must be valid or test")
    train = read_tokens(texts["train"])
    vocab = build_vocab(train, cap)
    x_train, y_train = batchify(encode(train, vocab), seq_len)
    x_test, y_test = batchify(encode(read_tokens(texts[split]), vocab), seq_len)
    for part, x in (("train", x_train), (split, x_test)):
        if len(x) == 0:
            raise DataError(f"{name}: the {part} text has fewer than {seq_len + 1} tokens, not one "
                            f"sequence of dataset.seq_len={seq_len}; lower seq_len or add text")
    return DataSet(name=name, x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test,
                   num_classes=len(vocab), mean=(0.0,), std=(1.0,))


def load(root: str = "data/ptb", seq_len: int = 20, vocab_size: int = 10000, eval_split: str = "test") -> DataSet:
    """`ptb.train.txt`, `ptb.valid.txt`, `ptb.test.txt` from `root` (never downloaded), cut into
    sequences of `seq_len` tokens (targets: the next token), the `vocab_size` most frequent words
    kept (0: all), `eval_split` (valid or test) evaluated each epoch."""
    root = os.path.expanduser(str(root))
    missing = [f for f in FILES.values() if not os.path.isfile(os.path.join(root, f))]
    if missing:
        raise DataError(
            f"ptb: missing {', '.join(missing)} in {os.path.abspath(root)}; put the PTB text files there "
            "(simple-examples/data/ from Mikolov's archive, one sentence per line) or train on the "
            "embedded corpus with dataset=embedded_text")
    texts = {}
    for split, fname in FILES.items():
        path = os.path.join(root, fname)
        try:
            with open(path, encoding="utf-8") as f:
                texts[split] = f.read().splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise DataError(f"ptb: cannot read {path} ({e}); it must be UTF-8 text in the PTB format") from e
    return from_splits("ptb", texts, seq_len, vocab_size, eval_split)


# -- the embedded corpus ----------------------------------------------------------------------

_WORD = re.compile(r"[a-z]+(?:'[a-z]+)?|[0-9]+(?:\.[0-9]+)?")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
_HEADING = re.compile(r"^[*=\-~^\"]{3,}$")
VALID_EVERY, MIN_WORDS = 10, 3  # sentence i -> valid if i % 10 == 8, test if == 9, else train


def embedded_sentences() -> list[str]:
    """pydoc_data's help texts as PTB-format lines, in a fixed order (sorted topics)."""
    from pydoc_data.topics import topics

    lines: list[str] = []
    for name in sorted(topics):
        for paragraph in re.split(r"\n\s*\n", topics[name]):
            rows = [r for r in paragraph.split("\n") if r.strip()]
            # Blocks indented by 3 or more are code samples and grammar rules (2 is a bullet
            # list's continuation); underlined lines are headings.
            if not rows or min(len(r) - len(r.lstrip()) for r in rows) > 2:
                continue
            rows = [r for r in rows if not _HEADING.match(r.strip())]
            for sentence in _SENTENCE_END.split(" ".join(rows)):
                words = ["N" if w[0].isdigit() else w for w in _WORD.findall(sentence.lower())]
                if len(words) >= MIN_WORDS:
                    lines.append(" ".join(words))
    return lines


def split_sentences(lines: Sequence[str]) -> dict[str, list[str]]:
    """Every 10th pair of sentences to valid and test: the three share topics and style."""
    out: dict[str, list[str]] = {s: [] for s in SPLITS}
    for i, line in enumerate(lines):
        r = i % VALID_EVERY
        out["valid" if r == VALID_EVERY - 2 else "test" if r == VALID_EVERY - 1 else "train"].append(line)
    return out


def load_embedded(seq_len: int = 20, vocab_size: int = 10000, eval_split: str = "test") -> DataSet:
    """The embedded English corpus, read like PTB (no files, no download)."""
    return from_splits("embedded_text", split_sentences(embedded_sentences()), seq_len, vocab_size, eval_split)
