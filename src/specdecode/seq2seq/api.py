"""Translate with an encoder-decoder verifier and (optionally) a block drafter: SpecDec.

    pair = TranslationPair.from_dir("path/to/pair")           # or load_pair() for the shipped one
    out = pair.translate(["En el principio crió Dios los cielos y la tierra."])
    out.texts, out.stats.tokens_per_target_call

`translate` runs the core engine (`engine.decode`) with `CachedSeq2Seq` as the target: the encoder
runs once per batch, the decoder cache is rolled back per row, and the rule is exact greedy,
lossless sampling, or SpecDec's relaxed top-beta/tau (approximate when beta > 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from specdecode.core.config import DecodeConfig, SamplingConfig
from specdecode.core.engine import decode
from specdecode.core.stats import DecodeStats, RowStats
from specdecode.core.verification import TopBetaTau, make_rule
from specdecode.seq2seq.block_drafter import BlockDrafter
from specdecode.seq2seq.cached import CachedSeq2Seq
from specdecode.seq2seq.nar_drafter import NARDrafter

# Past a few rows a verify pass over k + 1 positions is compute-bound on a CPU, and drafting for
# many rows costs more than it saves; drafting only for the last few rows still running keeps
# the gain of the long rows at a batch's tail (docs/findings.md: "Prices decide").
AUTO_DRAFT_BATCH = 4


@dataclass(frozen=True)
class TranslationOutput:
    texts: list[str]
    token_ids: list[list[int]]  # without the decoder start token and the final </s>
    stats: DecodeStats
    exact: bool  # False when a relaxed rule (beta > 1) may have changed the output


class TranslationPair:
    """A verifier (any `transformers` encoder-decoder), its tokenizer, and an optional drafter."""

    def __init__(self, verifier, tokenizer, drafter: BlockDrafter | None = None) -> None:
        self.verifier = verifier.eval()
        self.tokenizer = tokenizer
        self.drafter = drafter.eval() if drafter is not None else None
        self.cached = CachedSeq2Seq(self.verifier)
        if drafter is not None and drafter.cfg.vocab_size != verifier.config.vocab_size:
            raise ValueError(
                f"drafter vocabulary ({drafter.cfg.vocab_size}) differs from the verifier's "
                f"({verifier.config.vocab_size}); they must share the tokenizer"
            )

    def prepack(self, min_rows: int | None = None) -> TranslationPair:
        """oneDNN-packed fp32 weights for products of `min_rows` rows or more, in place.

        A verify pass scores k + 1 positions and a drafter pass k queries; on CPUs where MKL's
        default kernel runs a few rows at several times the cost of one, this is most of what a
        SpecDec round costs beyond a plain step. One-row products (every step of plain
        decoding) are packed too where that is faster on this machine (`kernels.row_plan`, per
        weight shape, which also pads short products; None), so plain decoding, the baseline
        of every speedup, gets the faster kernel as well (docs/findings.md: "Pad each short
        product"). Results agree with the default kernels to fp32 rounding.
        """
        from specdecode.backends.kernels import cpu_fp32, prepack_linears

        if not cpu_fp32(self.verifier.device, self.verifier.dtype):
            raise ValueError(
                f"prepacking is for fp32 models on the CPU; the verifier is "
                f"{self.verifier.dtype} on {self.verifier.device}"
            )
        prepack_linears(self.verifier, min_rows)
        self._drafter_on_verifier_kernels()
        return self

    def with_drafter(self, drafter: BlockDrafter | None) -> TranslationPair:
        """The same verifier (and kernels) and tokenizer with another drafter, e.g. `int8()`.

        A dense fp32 drafter is packed in place like the verifier, if the verifier is packed.
        """
        pair = TranslationPair(self.verifier, self.tokenizer, drafter)
        pair._drafter_on_verifier_kernels()
        return pair

    def _drafter_on_verifier_kernels(self) -> None:
        """A dense drafter takes the packing (and one-row switch) the verifier has, so both
        decode on one kernel; an int8 or already packed drafter (`output_kernel`) keeps its."""
        from specdecode.backends.kernels import kernel_summary

        rows = kernel_summary(self.verifier)["packed_from_rows"]
        if rows is not None and self.drafter is not None and self.drafter.output_kernel is None:
            self.drafter.prepack(rows)

    @classmethod
    def from_dir(
        cls,
        directory: str | Path,
        dtype: torch.dtype = torch.float32,
        prepack: bool = False,
        drafter_int8: bool = False,
    ) -> TranslationPair:
        """`<dir>/verifier` (a `save_pretrained` model + tokenizer) and optional `<dir>/drafter`.

        `prepack`: packed CPU kernels for multi-row products (`prepack`), fp32 only.
        `drafter_int8`: draft with an int8 copy of the drafter (`BlockDrafter.int8`, CPU).
        """
        from transformers import AutoModelForSeq2SeqLM, PreTrainedTokenizerFast

        directory = Path(directory)
        verifier_dir = directory / "verifier"
        if not (verifier_dir / "config.json").exists():
            raise FileNotFoundError(f"{directory} holds no verifier ({verifier_dir}/config.json)")
        verifier = AutoModelForSeq2SeqLM.from_pretrained(str(verifier_dir), dtype=dtype)
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(verifier_dir))
        drafter_dir = directory / "drafter"
        drafter = BlockDrafter.load(drafter_dir).to(dtype) if drafter_dir.exists() else None
        if drafter_int8:
            if drafter is None:
                raise ValueError(f"{directory} has no drafter to quantize")
            drafter = drafter.int8()
        pair = cls(verifier, tokenizer, drafter)
        return pair.prepack() if prepack else pair

    def output_cap(self, max_new_tokens: int) -> int:
        """The decoder's position table caps every output the same way, drafts or not."""
        positions = getattr(self.verifier.config, "max_position_embeddings", None)
        return min(max_new_tokens, positions - 1) if positions else max_new_tokens

    def translate(
        self,
        sources: list[str],
        *,
        block_size: int = 4,  # the shipped pair's fastest at batch 1 (docs/seq2seq.md)
        beta: int = 1,
        tau: float = 3.0,
        use_drafter: bool = True,
        batch_size: int = 32,
        max_new_tokens: int = 200,
        temperature: float = 0.0,
        seed: int | None = None,
        max_draft_batch: int | Literal["auto"] | None = "auto",
        sort_by_length: bool = True,
    ) -> TranslationOutput:
        """Outputs come back in the order of `sources`.

        `max_draft_batch`: draft only while at most this many rows of a batch are running
        (`DecodeConfig.max_draft_batch`; None: every round). "auto": `AUTO_DRAFT_BATCH` under
        exact verification, where the output is the same either way; every round under
        beta > 1, whose output depends on which rounds drafted, and so would depend on a row's
        neighbours.

        `sort_by_length`: batches of sources of similar length, longest first, so that the rows
        of a batch finish together instead of the batch running as long as its longest row
        (docs/seq2seq.md has the gain). A row's output does not depend on its neighbours
        (sampling: given the seed), so sorting changes no text.
        """
        if max_draft_batch == "auto":
            max_draft_batch = AUTO_DRAFT_BATCH if beta == 1 else None
        if not sources:
            raise ValueError("no sources to translate")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if use_drafter and self.drafter is None:
            raise ValueError("this pair has no drafter; pass use_drafter=False for plain decoding")
        sampling = SamplingConfig(temperature=temperature)
        relaxed = TopBetaTau(beta, tau)
        if not relaxed.exact and not sampling.greedy:
            raise ValueError("beta > 1 (top-beta/tau) is defined for greedy decoding only")
        rule = (
            make_rule("top-beta-tau", sampling, relaxed)
            if not relaxed.exact
            else make_rule(None, sampling)
        )
        max_new_tokens = self.output_cap(max_new_tokens)
        cfg = DecodeConfig(
            max_new_tokens=max_new_tokens,
            num_draft_tokens=block_size,
            drafting="model",  # its own block drafter, k tokens a round
            sampling=sampling,
            stop_token_ids=(self.tokenizer.eos_token_id,),
            seed=seed,
            max_draft_batch=max_draft_batch,
        )
        drafter = NARDrafter(self.drafter, self.cached, block_size) if use_drafter else None
        stats = DecodeStats([RowStats() for _ in sources])
        token_ids: list[list[int]] = [[] for _ in sources]
        order = list(range(len(sources)))
        if sort_by_length:
            lengths = [len(ids) for ids in self.tokenizer(sources).input_ids]
            order.sort(key=lambda i: -lengths[i])  # stable: equal lengths keep their order
        for start in range(0, len(sources), batch_size):
            rows = order[start : start + batch_size]
            enc = self.tokenizer(
                [sources[i] for i in rows],
                return_tensors="pt",
                padding=True,
                truncation=True,
                max_length=self.verifier.config.max_position_embeddings,
            )
            self.cached.encode(enc["input_ids"], enc["attention_mask"])
            part = DecodeStats([RowStats() for _ in rows])
            prompts = [[self.cached.decoder_start] for _ in rows]
            for event in decode(self.cached, drafter, rule, prompts, cfg, part):
                for row, new in zip(event.rows, event.new_tokens, strict=True):
                    token_ids[rows[row]].extend(new)
            stats.absorb(part, rows)
        eos = self.tokenizer.eos_token_id
        token_ids = [ids[:-1] if ids and ids[-1] == eos else ids for ids in token_ids]
        texts = self.tokenizer.batch_decode(token_ids, skip_special_tokens=True)
        return TranslationOutput(texts, token_ids, stats, rule.exact)
