"""The tokenizers the shapes models are trained with: OpenAI CLIP's (from the open_clip wheel's vocabulary),
and T5 unigram ones learnt from, or made of, the captions' words."""

from __future__ import annotations

import gzip
import io
import json
import string
import zipfile
from pathlib import Path

OPEN_CLIP_VOCAB = "open_clip/bpe_simple_vocab_16e6.txt.gz"
_CLIP_MERGES = 49152 - 256 - 2  # OpenAI CLIP's vocabulary: 256 bytes x2, merges, 2 specials = 49408


def clip_tokenizer_from_open_clip(source: Path, out: Path):
    """OpenAI CLIP's BPE tokenizer (ids identical to OpenAI CLIP) from the
    vocabulary file the ``open_clip_torch`` wheel ships; ``source`` is the
    wheel or the extracted ``bpe_simple_vocab_16e6.txt.gz``."""
    import transformers

    from machgen.builder.tiny import bytes_to_unicode

    raw = zipfile.ZipFile(source).read(OPEN_CLIP_VOCAB) if zipfile.is_zipfile(source) else source.read_bytes()
    lines = gzip.decompress(raw).decode("utf-8").split("\n")[1:_CLIP_MERGES + 1]
    merges = [tuple(line.split()) for line in lines]
    byte_chars = list(bytes_to_unicode().values())
    tokens = byte_chars + [c + "</w>" for c in byte_chars] + ["".join(m) for m in merges]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    out.mkdir(parents=True, exist_ok=True)
    (out / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(tokens)}, ensure_ascii=False))
    (out / "merges.txt").write_text("#version: 0.2\n" + "\n".join(" ".join(m) for m in merges) + "\n")
    tokenizer = transformers.CLIPTokenizer(str(out / "vocab.json"), str(out / "merges.txt"), model_max_length=77)
    for name in ("vocab.json", "merges.txt"):
        (out / name).unlink()
    return tokenizer


def train_t5_tokenizer(captions: list[str], vocab_size: int = 80):
    """A unigram T5 tokenizer trained with sentencepiece on ``captions``.

    Every lowercase letter is kept as a piece, so that words never seen in
    training (a fine-tuning concept) still tokenize without <unk>.
    """
    import sentencepiece
    import transformers

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(captions), model_writer=model, vocab_size=vocab_size, model_type="unigram",
        pad_id=0, eos_id=1, unk_id=2, bos_id=-1, hard_vocab_limit=False, character_coverage=1.0,
        required_chars=string.ascii_lowercase, minloglevel=2)
    processor = sentencepiece.SentencePieceProcessor(model_proto=model.getvalue())
    pieces = [(processor.id_to_piece(i), processor.get_score(i)) for i in range(processor.get_piece_size())]
    return transformers.T5TokenizerFast(vocab=pieces, extra_ids=0, model_max_length=512)


def caption_word_tokenizer(captions: list[str], word_score: float = -1.0, letter_score: float = -10.0):
    """A unigram T5 tokenizer whose pieces are the captions' words, whole,
    and every ASCII letter and digit.

    A caption is then a few tokens, one a word, which a small text encoder
    reads far sooner than the letters sentencepiece learns from so few
    sentences (about 40 pieces, 17 to 30 a caption); a word never seen in
    training still tokenizes, letter by letter, without <unk>.
    """
    import transformers

    words = sorted({word for caption in captions for word in caption.split()})
    letters = sorted(set(string.ascii_letters + string.digits) | {c for word in words for c in word})
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", letter_score)]
    pieces += [("\u2581" + word, word_score) for word in words]
    pieces += [(letter, letter_score) for letter in letters]
    return transformers.T5TokenizerFast(vocab=pieces, extra_ids=0, model_max_length=512)
