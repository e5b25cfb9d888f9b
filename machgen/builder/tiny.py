"""In-memory tokenizers and a text encoder for tiny test models (no model hub is reachable).

The CLIP tokenizer is a byte-level BPE over single characters with a few
merges; the T5 tokenizer is a unigram model over letters and a handful of
words; the Llama and Gemma ones byte-level BPEs with their special tokens. All
save with ``save_pretrained`` and load back with the classes a diffusers
pipeline names in its ``model_index.json``.
"""

from __future__ import annotations

_T5_WORDS = ("a", "the", "at", "of", "photo", "cat", "dog", "red", "green", "blue", "circle", "square",
             "triangle", "top", "bottom", "left", "right", "center")


def bytes_to_unicode() -> dict[int, str]:
    # GPT-2/CLIP's reversible byte-to-printable-character table.
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1))
                 + list(range(ord("\xae"), ord("\xff") + 1)))
    codes = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return dict(zip(printable, (chr(c) for c in codes)))


def tiny_clip_tokenizer(model_max_length: int = 77):
    import transformers

    chars = list(bytes_to_unicode().values())
    vocab: dict[str, int] = {}
    for c in chars:
        vocab[c] = len(vocab)
    for c in chars:
        vocab[c + "</w>"] = len(vocab)
    merges = [("c", "a"), ("ca", "t</w>"), ("o", "g</w>"), ("d", "og</w>"), ("r", "e"), ("re", "d</w>")]
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    return transformers.CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=model_max_length)


def tiny_t5_tokenizer(model_max_length: int = 512):
    import string

    import transformers

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [(c, -3.0) for c in string.ascii_letters + string.digits + string.punctuation]
    pieces += [("\u2581" + w, -1.0) for w in _T5_WORDS]
    return transformers.T5TokenizerFast(vocab=pieces, extra_ids=0, model_max_length=model_max_length)


def tiny_t5_encoder(tokenizer, model_class: str = "T5EncoderModel"):
    """A two-layer T5-family text encoder over ``tokenizer`` (``model_class``:
    T5EncoderModel for Flux and LTX, UMT5EncoderModel for Wan), in eval mode."""
    import transformers

    config_class = getattr(transformers, model_class.replace("EncoderModel", "Config"))
    return getattr(transformers, model_class)(config_class(
        vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.pad_token_id,
    )).eval()


def tiny_llama_tokenizer(model_max_length: int = 512):
    """A byte-level BPE in Llama 3's manner: a begin-of-text token in front,
    none at the end; ``<|end_of_text|>`` is the end (and, in
    HiDreamImagePipeline, the padding) token."""
    import tokenizers
    import transformers

    vocab = {c: i for i, c in enumerate(bytes_to_unicode().values())}
    merges = [("c", "a"), ("ca", "t"), ("\u0120", "a"), ("r", "e"), ("re", "d")]
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    begin, end = "<|begin_of_text|>", "<|end_of_text|>"
    vocab[begin], vocab[end] = len(vocab), len(vocab) + 1
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    tokenizer.post_processor = tokenizers.processors.TemplateProcessing(
        single=f"{begin} $A", pair=f"{begin} $A {begin} $B", special_tokens=[(begin, vocab[begin])])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=begin, eos_token=end,
                                                model_max_length=model_max_length)


def tiny_gemma_tokenizer(model_max_length: int = 1024):
    """A byte-level BPE in Gemma's manner: ``<bos>`` in front, ``<pad>``
    (id 0) to pad, ``<eos>`` to end (LTX2Pipeline pads on the left)."""
    import tokenizers
    import transformers

    special = ("<pad>", "<eos>", "<bos>", "<unk>")
    vocab = {token: i for i, token in enumerate(special)}
    for c in bytes_to_unicode().values():
        vocab.setdefault(c, len(vocab))
    merges = [("r", "o"), ("ro", "b"), ("\u0120", "a"), ("c", "a")]
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    tokenizer.post_processor = tokenizers.processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", vocab["<bos>"])])
    return transformers.GemmaTokenizerFast(tokenizer_object=tokenizer, bos_token="<bos>", eos_token="<eos>",
                                           pad_token="<pad>", unk_token="<unk>", model_max_length=model_max_length)
