"""A shared source/target BPE vocabulary trained on the corpus, saved as a `transformers` tokenizer.

Shared because the verifier ties its encoder and decoder embeddings (as SpecDec's
``--share-all-embeddings``), and the block drafter reuses those embeddings for its mask queries.
Metaspace pre-tokenisation keeps word boundaries in the tokens, so decoding gives back detokenised
text for sacrebleu without a Moses detokeniser.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

PAD, EOS, UNK, MASK = "<pad>", "</s>", "<unk>", "<mask>"
SPECIALS = (PAD, EOS, UNK, MASK)  # ids 0, 1, 2, 3


def train_tokenizer(texts: Iterable[str], vocab_size: int = 8000) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIALS), min_frequency=2, show_progress=False
    )
    tok.train_from_iterator(texts, trainer=trainer)
    from tokenizers.processors import TemplateProcessing

    tok.post_processor = TemplateProcessing(
        single=f"$A {EOS}", special_tokens=[(EOS, tok.token_to_id(EOS))]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, eos_token=EOS, unk_token=UNK, mask_token=MASK
    )


def load_tokenizer(directory: str | Path) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast.from_pretrained(str(directory))
