"""What a SpecDec round costs, in plain steps, for a verifier of the shipped size, of its width
with a decoder twice as deep, and of Transformer-base size on this CPU, and so how many tokens
per verifier call 2x and 3x need.

Random weights (the cost of a pass does not depend on them), batch 1, a 20-token committed
prefix and a 30-token source: a plain step (1 position), a verify pass over 5 positions (k = 4)
and a pass of a 2-layer int8 block drafter of the verifier's width, each through the engine's
own objects (`CachedSeq2Seq`, `NARDrafter`), interleaved, median of 50 after 10 of warm-up.
Each size runs twice: with the engine's kernels (oneDNN-packed copies for products of 2 rows
or more, MKL for one row) and with every product packed, since the faster one-row kernel is the
fair baseline for plain decoding.

    python benchmarks/studies/specdec-round-cost/specdec_round_cost.py
"""

from __future__ import annotations

import statistics
import time

import torch
from transformers import MarianConfig, MarianMTModel

from specdecode.backends.kernels import prepack_linears
from specdecode.seq2seq.block_drafter import BlockDrafter, BlockDrafterConfig
from specdecode.seq2seq.cached import CachedSeq2Seq
from specdecode.seq2seq.nar_drafter import NARDrafter

SIZES = {  # name: d_model, encoder layers, decoder layers, FFN, heads
    "shipped size (d 256, 3+3 layers)": (256, 3, 3, 1024, 4),
    "shipped width, deeper decoder (d 256, 3+6 layers)": (256, 3, 6, 1024, 4),
    "Transformer-base size (d 512, 6+6 layers)": (512, 6, 6, 2048, 8),
}
VOCAB, PREFIX, K = 8000, 20, 4


def pair(d: int, encoder_layers: int, decoder_layers: int, ffn: int, heads: int, min_rows: int):
    torch.manual_seed(0)
    cfg = MarianConfig(
        vocab_size=VOCAB, decoder_vocab_size=VOCAB, d_model=d, encoder_layers=encoder_layers,
        decoder_layers=decoder_layers, encoder_attention_heads=heads, decoder_attention_heads=heads,
        encoder_ffn_dim=ffn, decoder_ffn_dim=ffn, max_position_embeddings=256, pad_token_id=0,
        eos_token_id=1, decoder_start_token_id=0, forced_eos_token_id=None,
    )  # fmt: skip
    verifier = prepack_linears(MarianMTModel(cfg).eval(), min_rows)
    drafter_cfg = BlockDrafterConfig(vocab_size=VOCAB, d_model=d, layers=2, heads=heads, ffn=ffn,
                                     block_size=K + 1, mask_id=3)  # fmt: skip
    cached = CachedSeq2Seq(verifier)
    src = torch.randint(4, VOCAB, (1, 30))
    cached.encode(src, torch.ones_like(src))
    return cached, NARDrafter(BlockDrafter(drafter_cfg).eval().int8(), cached, K)


@torch.inference_mode()
def costs(cached: CachedSeq2Seq, drafter: NARDrafter, repeats: int = 60) -> dict[str, float]:
    seq = torch.randint(4, VOCAB, (1, 256))
    seq[0, 0] = cached.decoder_start
    one, window = torch.ones(1, 1, dtype=torch.bool), torch.ones(1, K + 1, dtype=torch.bool)
    times: dict[str, list[float]] = {"step": [], "verify": [], "draft": []}
    for _ in range(repeats):
        cached.reset(1)
        drafter.start(1)
        cached.forward(seq[:, :PREFIX], torch.ones(1, PREFIX, dtype=torch.bool))
        drafter.propose(seq, torch.tensor([PREFIX]), torch.tensor([K]), None)
        t0 = time.perf_counter()
        cached.forward(seq[:, PREFIX : PREFIX + 1], one)
        t1 = time.perf_counter()
        cached.truncate(torch.tensor([PREFIX]))
        t2 = time.perf_counter()
        cached.forward(seq[:, PREFIX : PREFIX + K + 1], window, logits_to_keep=K + 1)
        t3 = time.perf_counter()
        drafter.propose(seq, torch.tensor([PREFIX + 3]), torch.tensor([K]), None)
        t4 = time.perf_counter()
        for name, seconds in (("step", t1 - t0), ("verify", t3 - t2), ("draft", t4 - t3)):
            times[name].append(seconds)
    return {name: 1000 * statistics.median(v[10:]) for name, v in times.items()}


def main() -> None:
    torch.set_num_threads(2)
    for name, shape in SIZES.items():
        for min_rows, kernels in ((2, "engine's kernels"), (1, "every product packed")):
            ms = costs(*pair(*shape, min_rows))
            verify, draft = ms["verify"] / ms["step"], ms["draft"] / ms["step"]
            rounds = verify + draft
            print(
                f"{name}, {kernels}: plain step {ms['step']:.2f} ms; verify over {K + 1} "
                f"{ms['verify']:.2f} ms ({verify:.2f} steps); int8 drafter, k = {K}, "
                f"{ms['draft']:.2f} ms ({draft:.2f} steps); a round {rounds:.2f} steps: 2x needs "
                f"{2 * rounds:.2f} tokens per call, 3x {3 * rounds:.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
