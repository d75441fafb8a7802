"""Would tree drafting (several candidates per position, verified in one pass) lift SpecDec
on the shipped pair to 2x? An optimistic bound, measured on the real models.

A block drafter scores every position of its block independently, so a token tree is the
product of each position's top-m_j candidates; greedy verification accepts the longest path
whose tokens the verifier's greedy output follows. Steps:

1. the verifier's greedy translations of the first N test verses (plain decoding);
2. the shipped drafter's block after every prefix of each translation, teacher-forced in one
   training-form pass per verse; the rank of the true next tokens in each block position;
3. rounds replayed along each translation (each round starts where the last one ended): for a
   tree of shape (m_1, ..., m_k), a round accepts while the true token ranks under m_j;
4. the verifier's pass over n positions after a 30-token prefix, timed (median of 200): the
   last committed token plus every node of the tree (k + 1 for the chain);
5. a real SpecDec run (int8 drafter, k = 4, batch 1) and plain decoding on the same verses give
   the chain's round time and a plain step; a tree's round is the chain's plus the extra verify
   time of its nodes. Building tree masks and compacting the accepted path's cache cost nothing
   here, which is what makes the figure an upper bound.

    python benchmarks/studies/specdec-tree-bound/specdec_tree_bound.py [--verses 100]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch
from transformers import DynamicCache, EncoderDecoderCache

from specdecode.cli.seq2seq import SHIPPED_PAIR
from specdecode.seq2seq.api import TranslationPair
from specdecode.seq2seq.corpus import read_split

SHAPES = [(1, 1, 1, 1), (2, 1, 1, 1), (3, 1, 1, 1), (2, 2, 1, 1), (3, 2, 1, 1), (2, 2, 2, 1),
          (2, 2, 2, 2), (3, 2, 2, 1), (4, 2, 2, 1), (3, 3, 2, 2)]  # fmt: skip
MISS = 1 << 30  # rank of a position past the end of the translation


def ranks_along(pair: TranslationPair, source: str, output: list[int], k: int) -> torch.Tensor:
    """[T, k]: rank, in the drafter's block after prefix t, of each of the next k true tokens."""
    tok = pair.tokenizer
    enc = tok([source], return_tensors="pt")
    states = pair.verifier.get_encoder()(**enc).last_hidden_state
    seq = torch.tensor([[pair.cached.decoder_start, *output, tok.eos_token_id]])  # [1, T + 1]
    t = seq.shape[1] - 1  # rounds may start after each of the first T slots
    logits = pair.drafter(
        seq, torch.tensor([t + 1]), states, enc["attention_mask"], k, starts=torch.arange(t)[None]
    )[0]  # [T, k, vocab]
    index = torch.arange(t)[:, None] + 1 + torch.arange(k)  # [T, k]
    inside = index < t + 1
    true = seq[0, index.clamp(max=t)]  # [T, k]
    true_logit = logits.gather(2, true[..., None])  # [T, k, 1]
    ranks = (logits > true_logit).sum(-1)  # [T, k]
    return torch.where(inside, ranks, MISS)


def replay(all_ranks: list[torch.Tensor], shape: tuple[int, ...]) -> float:
    """Tokens per verifier call when rounds follow one another along each translation."""
    calls = tokens = 0
    for ranks in all_ranks:
        start, length = 0, ranks.shape[0]
        while start < length:
            accepted = 0
            while accepted < len(shape) and int(ranks[start, accepted]) < shape[accepted]:
                accepted += 1
            step = min(accepted + 1, length - start)
            calls, tokens, start = calls + 1, tokens + step, start + step
    return tokens / calls


def positions(shape: tuple[int, ...]) -> int:
    """Positions the verifier scores in a round: the last committed token and every node."""
    return 1 + sum(math.prod(shape[: j + 1]) for j in range(len(shape)))


def verify_ms(pair: TranslationPair, widths: list[int], reps: int = 200) -> dict[int, float]:
    """Median time of the verifier's pass over n new positions after a 30-token prefix."""
    model, enc = pair.verifier, pair.tokenizer(["Y dijo Dios: Sea la luz."], return_tensors="pt")
    encoded = model.get_encoder()(**enc)
    prefix = torch.randint(5, 8000, (1, 30), generator=torch.Generator().manual_seed(0))
    times: dict[int, list[float]] = {n: [] for n in widths}
    for rep in range(reps + 20):
        for n in widths:  # interleaved
            cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
            kwargs = dict(encoder_outputs=encoded, attention_mask=enc["attention_mask"],
                          past_key_values=cache, use_cache=True)  # fmt: skip
            model(decoder_input_ids=prefix, **kwargs)
            t0 = time.perf_counter()
            model(decoder_input_ids=prefix[:, :n] if n <= 30 else prefix.repeat(1, 3)[:, :n],
                  **kwargs)  # fmt: skip
            if rep >= 20:
                times[n].append(time.perf_counter() - t0)
    return {n: 1e3 * statistics.median(ts) for n, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--verses", type=int, default=100)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    pair = TranslationPair.from_dir(SHIPPED_PAIR, prepack=True)
    sources = [v.src for v in read_split("test")[: args.verses]]
    k = max(map(len, SHAPES))
    with torch.inference_mode():
        plain = pair.translate(sources, use_drafter=False, batch_size=32, max_new_tokens=100)
        all_ranks = [ranks_along(pair, s, o, k) for s, o in zip(sources, plain.token_ids,
                                                                   strict=True)]  # fmt: skip
        widths = sorted({positions(s) for s in SHAPES})
        cost = verify_ms(pair, widths)
        int8 = pair.with_drafter(pair.drafter.int8())
        timed = {}
        for _ in range(2):  # interleaved, fastest of two
            for name, kwargs in (("ar", dict(use_drafter=False)), ("sd", dict(block_size=k))):
                out = int8.translate(sources, batch_size=1, max_new_tokens=100, **kwargs)
                per_call = out.stats.wall_seconds / out.stats.target_passes
                timed[name] = min(timed.get(name, math.inf), 1e3 * per_call)
    step, round_chain = timed["ar"], timed["sd"]
    print(f"shipped pair, first {len(sources)} test verses, batch 1, greedy; plain step "
          f"{step:.2f} ms, SpecDec round at k = {k} (int8 drafter) {round_chain:.2f} ms; "
          f"verifier pass over n positions: "
          + ", ".join(f"{n}: {ms:.2f} ms" for n, ms in cost.items()))  # fmt: skip
    print("tree shape      positions  tokens/call  round ms (bound)  speedup vs ar (bound)")
    for shape in SHAPES:
        n = positions(shape)
        per_call = replay(all_ranks, shape)
        round_ms = round_chain + cost[n] - cost[k + 1]
        print(f"{shape!s:15s} {n:9d}  {per_call:11.3f}  {round_ms:16.2f}  "
              f"{per_call * step / round_ms:21.2f}x")  # fmt: skip
    print(json.dumps({"step_ms": step, "round_chain_ms": round_chain, "verify_ms": cost}))


if __name__ == "__main__":
    main()
