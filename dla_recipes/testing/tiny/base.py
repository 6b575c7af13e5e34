"""The sizes every tiny model shares, the offline tokenizer, and the llama-like config values.

Sizes: hidden 64, 4 attention heads (2 key/value heads where the family has GQA), intermediate 128, 3 layers,
vocabulary 128 (``PAD_ID`` is its last id). ``llama_like(**over)`` is the keyword set of a llama-shaped
``transformers`` config with these sizes, ``over`` on top; ``COMMON`` the vocabulary / special-token part of it.
"""

from __future__ import annotations

# Config keyword arguments are spelled as keyword arguments: dict(name=value), as in Config(name=value).
# ruff: noqa: C408

VOCAB = 128
HIDDEN = 64
HEADS = 4
KV_HEADS = 2
INTER = 128
LAYERS = 3
MAX_POS = 256
SOFTCAP = 0.5  # tiny logits have std ~0.2: a cap of 0.5 bends them measurably (real models: 30)


# --------------------------------------------------------------------------------------------------------------
# tokenizer
# --------------------------------------------------------------------------------------------------------------


def tokenizer(vocab_size: int = VOCAB):
    """An offline word-level tokenizer with exactly ``vocab_size`` ids.

    Tokens ``"w0" .. "w{vocab_size-3}"`` are ids ``0 .. vocab_size-3``; ``"[UNK]"`` is ``vocab_size-2`` and
    ``"[PAD]"`` is ``vocab_size-1`` (both inside the model vocabulary). Words are split on whitespace; padding is on
    the left, as nnterp expects.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 3:
        raise ValueError("vocab_size must be at least 3")
    vocab = {f"w{i}": i for i in range(vocab_size - 2)}
    vocab["[UNK]"] = vocab_size - 2
    vocab["[PAD]"] = vocab_size - 1
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]")
    fast.padding_side = "left"
    return fast


PAD_ID = VOCAB - 1

# --------------------------------------------------------------------------------------------------------------
# configs
# --------------------------------------------------------------------------------------------------------------

COMMON = dict(vocab_size=VOCAB, pad_token_id=PAD_ID, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)


def llama_like(**over) -> dict:
    kw = dict(
        COMMON,
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=MAX_POS,
    )
    kw.update(over)
    return kw
