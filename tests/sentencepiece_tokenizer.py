"""A SentencePiece-style tokenizer as Llama's and Mistral's tokenizer.json have it, made here: words
carry a leading U+2581 for their space, the decoder turns it back and strips the text's first space,
and a character outside the vocabulary is its UTF-8 bytes as <0xXX> tokens (byte fallback), which
the decoder shows as one U+FFFD per byte of an incomplete character."""
from tokenizers import Tokenizer, decoders, models, normalizers

SPACE = "\u2581"


def sentencepiece_tokenizer(words=("the", "cat", "a")) -> Tokenizer:
    vocab = {"<unk>": 0, SPACE: 1, **{f"<0x{b:02X}>": 2 + b for b in range(256)}}
    merges = []
    for word in (SPACE + w for w in words):
        for ch in word:
            vocab.setdefault(ch, len(vocab))
        for i in range(2, len(word) + 1):   # merge the prefix so far with the next character
            merges.append((word[:i - 1], word[i - 1]))
            vocab.setdefault(word[:i], len(vocab))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])
    tokenizer.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    return tokenizer
