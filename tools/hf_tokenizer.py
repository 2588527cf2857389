"""
Hugging Face tokenizers that give exactly our token ids, for
tools/export_hf.py: a character vocabulary's (meta.json's itos) and
GPT-2's byte-level BPE rebuilt from tiktoken's r50k_base ranks.
Design notes: docs/export.md
"""

from data import BPE_EOT, BPE_TOKENS, gpt2_encoding

EOT = "<|endoftext|>"  # GPT-2's end-of-text token, id BPE_EOT


def vocabulary(meta):
    """'char' (meta.json's itos), 'bpe' (GPT-2's) or None: the one
    place that tells a dataset's vocabulary."""
    if "itos" in meta:
        return "char"
    if meta.get("tokenizer") in ("r50k_base", "gpt2"):
        return "bpe"
    return None


def char_tokenizer(itos, max_length):
    """Each character of itos its index: a pre-tokenizer isolating every
    character ([\\s\\S] matches newlines too), a WordLevel lookup without
    an unknown token (an unknown character is an error), a Fuse decoder;
    the newline is eos and pad."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if len(set(itos)) != len(itos) or any(len(ch) != 1 for ch in itos):
        raise ValueError("meta.json 'itos' must list distinct single characters")
    vocab = {ch: i for i, ch in enumerate(itos)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=None))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    special = {"eos_token": "\n", "pad_token": "\n"} if "\n" in itos else {}
    return PreTrainedTokenizerFast(tokenizer_object=core, model_max_length=max_length,
                                   clean_up_tokenization_spaces=False, **special)


def merges_from_ranks(ranks):
    """The BPE merges, in rank order as (left bytes, right bytes), from
    tiktoken's {token bytes: rank}: a token of rank r merges the two
    pieces that BPE with the ranks below r ends with on its bytes."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) < 2:
            continue
        parts = [token[i:i + 1] for i in range(len(token))]
        while len(parts) > 2:
            best, i = min((ranks.get(parts[i] + parts[i + 1], rank), i)
                          for i in range(len(parts) - 1))
            if best >= rank:
                break
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        if len(parts) != 2:
            raise ValueError(f"tiktoken token {token!r} (rank {rank}) is not a merge of two "
                             "lower-ranked tokens")
        merges.append(tuple(parts))
    return merges


def bpe_tokenizer(max_length):
    """GPT-2's byte-level BPE tokenizer, rebuilt offline from the
    r50k_base ranks."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    encoding = gpt2_encoding()
    if encoding.n_vocab != BPE_TOKENS or encoding.eot_token != BPE_EOT:
        raise ValueError(f"tiktoken's ranks have {encoding.n_vocab} tokens (eot "
                         f"{encoding.eot_token}), expected {BPE_TOKENS} (eot {BPE_EOT})")
    ranks = {encoding.decode_single_token_bytes(i): i
             for i in range(encoding.n_vocab) if i != BPE_EOT}
    symbols = bytes_to_unicode()
    spell = lambda token: "".join(symbols[b] for b in token)  # noqa: E731
    vocab = {spell(token): rank for token, rank in ranks.items()}
    vocab[EOT] = BPE_EOT
    merges = [(spell(a), spell(b)) for a, b in merges_from_ranks(ranks)]
    core = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens([AddedToken(EOT, special=True, normalized=False)])
    return PreTrainedTokenizerFast(tokenizer_object=core, model_max_length=max_length,
                                   bos_token=EOT, eos_token=EOT, unk_token=EOT,
                                   clean_up_tokenization_spaces=False)
