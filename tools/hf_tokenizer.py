"""
Hugging Face tokenizers that give exactly our token ids, for tools/export_hf.py: a model exported
without one cannot be fed text by AutoTokenizer users or by lm-evaluation-harness.

    char      (meta.json holds itos) one token per character, id = index in itos; a character
              outside the vocabulary is an error at encode time, never silently dropped
    r50k_base (GPT-2 BPE through tiktoken) the byte-level BPE rebuilt from tiktoken's ranks, so
              that tiktoken and the HF tokenizer split every text the same way

A character vocabulary has no end-of-text token. The newline stands in for it (eos and pad),
because lm-eval needs one to pad batches and to prefix an empty context, and a line break is
where a passage of the training text naturally starts; without a newline in the vocabulary the
tokenizer has no special tokens.

transformers and tokenizers are imported inside the functions: the repository runs without them.
"""

from data import BPE_EOT, BPE_TOKENS, gpt2_encoding

NEWLINE = "\n"
EOT = "<|endoftext|>"  # GPT-2's end-of-text token, id BPE_EOT


def tokenizer_kind(meta):
    """'char', 'bpe', or None for a meta.json this module cannot rebuild a tokenizer for."""
    if "itos" in meta:
        return "char"
    if meta.get("tokenizer") in ("r50k_base", "gpt2"):
        return "bpe"
    return None


def char_tokenizer(itos, max_length):
    """A PreTrainedTokenizerFast mapping each character of itos to its index. The pre-tokenizer
    isolates every character (the class [\\s\\S] also matches newlines), the WordLevel model looks
    each one up, and the Fuse decoder joins them back without adding spaces."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if len(set(itos)) != len(itos) or any(len(ch) != 1 for ch in itos):
        raise ValueError("meta.json 'itos' must list distinct single characters")
    core = Tokenizer(models.WordLevel(vocab={ch: i for i, ch in enumerate(itos)}, unk_token=None))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    special = {"eos_token": NEWLINE, "pad_token": NEWLINE} if NEWLINE in itos else {}
    return PreTrainedTokenizerFast(tokenizer_object=core, model_max_length=max_length,
                                   clean_up_tokenization_spaces=False, **special)


def byte_symbols():
    """GPT-2's byte-level BPE spells every byte as one printable character: bytes that already
    print (and are not a space) stand for themselves, each of the others is given the next unused
    code point from 256 up, in byte order. Returns the list indexed by byte value."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAC + 1)) | set(range(0xAE, 0xFF + 1))
    symbols, spare = [], 256
    for byte in range(256):
        if byte in printable:
            symbols.append(chr(byte))
        else:
            symbols.append(chr(spare))
            spare += 1
    return symbols


def merges_from_ranks(ranks):
    """The merge list a BPE tokenizer needs, recovered from tiktoken's ranks ({token bytes: rank}):
    a token of rank r was made by merging the two pieces that BPE, using only ranks below r, ends
    with on its bytes. Returned in rank order, as (left bytes, right bytes)."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) < 2:
            continue
        parts = [token[i:i + 1] for i in range(len(token))]
        while len(parts) > 2:
            candidates = [(ranks.get(parts[i] + parts[i + 1], rank), i) for i in range(len(parts) - 1)]
            best, i = min(candidates)
            if best >= rank:
                break
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        if len(parts) != 2:
            raise ValueError(f"tiktoken token {token!r} (rank {rank}) is not a merge of two lower-ranked "
                             "tokens")
        merges.append(tuple(parts))
    return merges


def bpe_tokenizer(max_length):
    """GPT-2's tokenizer, built offline from tiktoken's r50k_base ranks (data.gpt2_encoding: the
    same ranks the prepare scripts encoded the data with): a byte-level BPE whose vocabulary
    spells each token's bytes with byte_symbols(), its merges from merges_from_ranks(), GPT-2's
    pre-tokenizer regex, and <|endoftext|> as the one special token."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    encoding = gpt2_encoding()
    if encoding.n_vocab != BPE_TOKENS or encoding.eot_token != BPE_EOT:
        raise ValueError(f"tiktoken's ranks have {encoding.n_vocab} tokens (eot {encoding.eot_token}), "
                         f"expected {BPE_TOKENS} (eot {BPE_EOT})")
    ranks = {encoding.decode_single_token_bytes(i): i for i in range(encoding.n_vocab) if i != BPE_EOT}
    symbols = byte_symbols()
    spell = lambda token: "".join(symbols[b] for b in token)  # noqa: E731
    vocab = {spell(token): rank for token, rank in ranks.items()}
    vocab[EOT] = BPE_EOT
    merges = [(spell(a), spell(b)) for a, b in merges_from_ranks(ranks)]
    core = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens([AddedToken(EOT, special=True, normalized=False)])
    return PreTrainedTokenizerFast(tokenizer_object=core, model_max_length=max_length, bos_token=EOT,
                                   eos_token=EOT, unk_token=EOT, clean_up_tokenization_spaces=False)


def build(meta, max_length):
    """The tokenizer for a dataset's meta.json, or None if its kind is unknown."""
    kind = tokenizer_kind(meta)
    if kind == "char":
        return char_tokenizer(meta["itos"], max_length)
    if kind == "bpe":
        return bpe_tokenizer(max_length)
    return None


def special_ids(tokenizer):
    """bos / eos / pad ids for the model's config.json: HF's defaults for these (GPT-2's 50256,
    LLaMA's 1 and 2) would name ordinary tokens of our vocabularies."""
    if tokenizer is None:
        return {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    return {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id}
