"""Could another way of sampling make a drafted token's fate at T = 0.7 easier to foretell?

A length head gains over a constant k only as far as it can tell, before verification, which
drafted tokens the target will keep. Under greedy decoding it can (the shipped head beats the
best constant by 9-20% on this CPU); under sampling at T = 0.7 the drafter-side heads replay
4.5-6.6% and measure 1-3%. Three ideas that would change what a head can know, each scored here
on the same texts before building any of them into the engine:

* **Shared Gumbel noise** (drafter-invariant speculative decoding, Daliri et al. 2024): drafter
  and target draw every position's token as argmax(log law + g) with the same noise g, and a
  drafted token is kept when the two argmaxes agree. It is lossless (the committed token is the
  target's own Gumbel-max draw), the text no longer depends on the drafts, and the drafter knows
  the noise, so sampling looks like greedy decoding on noised logits, where heads do well. A
  head could read the noised law's margin.
* **A colder drafter**: drafting from the drafter at temperature T_d < T (every verdict still
  uses the law each token was drawn from, so the output law is the target's) makes drafts more
  often the drafter's top token, whose fate the drafter's confidence tells better.
* **The target's view where a round starts**: the target's law at the position before a drafted
  token (its entropy, its top probability, and how far the drafter's law there was from it) is
  known from the last verify pass when that position is a round's bonus token. Here every
  position gets it, where a real round has it for its first drafted token only: an upper bound.

For each prompt the target samples 64 tokens at T = 0.7; both models then read the text in one
pass, and the laws of each position are kept (the 1024 tokens of most joint mass: the rest
carries under 1e-4 of either law). Each position then gets a drafted token and a verdict under
each rule, drawn from its law (several draws, averaged), and a logistic head on drafter-side
features is fitted on half the prompts and scores the other half (cross-fitted). Rounds are
replayed along the text at this CPU's prices (a drafted token 0.15 target steps; the verify pass
of the per-count row plans, 2026-11-24): the best constant k of 1..12 against the head's
threshold rule (1 - prod P(accept) > h, rounds of 1..12) at its best h.

    python benchmarks/studies/specdecpp-predictability/specdecpp_predictability.py
        [--prompts 12] [--cache PATH]

The laws are collected once into `--cache` (about 30 s a prompt on 2 cores) and reused.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from specdecode.acceptance.metrics import auc
from specdecode.backends.kernels import quantize_int8
from specdecode.models.store import load_causal_lm
from specdecode.prompts import load_prompts, render_chat

TEMPERATURE = 0.7
NEW_TOKENS = 64
KEPT = 1024  # tokens of most joint mass kept per position
DRAFT_PRICE = 0.15  # a drafted token, in target steps (int8 drafter, this CPU)
# verify pass for 1..12 drafted tokens, in target steps (the calibration of 2026-11-24,
# per-count row plans)
VERIFY = (1.00, 0.97, 0.96, 0.93, 0.92, 1.13, 1.21, 1.22, 1.26, 1.26, 1.37, 1.50)
THRESHOLDS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
DRAWS = 4  # verdict draws per position, averaged
SETS = (("humaneval", False), ("mtbench", True))


@torch.inference_mode()
def collect(num_prompts: int, path: Path) -> dict[str, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per set, per prompt: (log p, log q) [64, KEPT] on a text the target sampled."""
    torch.manual_seed(0)
    target, tokenizer = load_causal_lm("qwen2.5-coder-1.5b")
    drafter = quantize_int8(load_causal_lm("qwen2.5-coder-0.5b")[0])
    out: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for name, chat in SETS:
        out[name] = []
        for prompt in load_prompts(name, limit=num_prompts):
            text = render_chat(tokenizer, prompt.text) if chat else prompt.text
            ids = tokenizer(text, return_tensors="pt").input_ids  # [1, n]
            full = target.generate(
                ids, do_sample=True, temperature=TEMPERATURE, top_k=0, top_p=1.0,
                repetition_penalty=1.0, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
            )  # fmt: skip
            start = ids.shape[1] - 1
            log_p = (target(full).logits[0, start:-1].float() / TEMPERATURE).log_softmax(-1)
            log_q = (drafter(full).logits[0, start:-1].float() / TEMPERATURE).log_softmax(-1)
            vocab = min(log_p.shape[-1], log_q.shape[-1])  # [64, vocab] each
            log_p, log_q = log_p[:, :vocab], log_q[:, :vocab]
            kept = (log_p.exp() + log_q.exp()).topk(KEPT, -1).indices  # [64, KEPT]
            out[name].append((log_p.gather(-1, kept), log_q.gather(-1, kept)))
            print(f"collected {name} {prompt.id}", flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(out, path)
    return out


def standard_verdicts(log_p, log_q, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """Leviathan's rule: z ~ q, kept when u < p(z)/q(z). -> labels [n], features [n, 4]:
    log q(z), log u, the law's entropy and top log probability (what `head-u` reads)."""
    q = log_q.exp()
    z = torch.multinomial(q, 1, generator=gen)  # [n, 1]
    u = torch.rand(len(q), generator=gen)
    ratio = (log_p.gather(-1, z) - log_q.gather(-1, z)).exp().squeeze(-1)
    entropy = -(q * log_q.clamp(min=-80)).sum(-1)
    features = torch.stack([log_q.gather(-1, z)[:, 0], u.log(), entropy, log_q.amax(-1)], -1)
    return (u < ratio).float(), features


def gumbel_verdicts(log_p, log_q, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """Shared noise g: z = argmax(log q + g), kept when argmax(log p + g) is z. Features: the
    noised law's margin and top log probability, log q(z), the law's entropy."""
    uniforms = torch.rand(log_q.shape, generator=gen).clamp(1e-20, 1 - 1e-7)
    noised_q = log_q - torch.log(-torch.log(uniforms))  # [n, KEPT]
    noised_p = log_p - torch.log(-torch.log(uniforms))
    z = noised_q.argmax(-1, keepdim=True)  # [n, 1]
    top2 = noised_q.topk(2, -1).values
    entropy = -(log_q.exp() * log_q.clamp(min=-80)).sum(-1)
    features = torch.stack(
        [top2[:, 0] - top2[:, 1], noised_q.log_softmax(-1).amax(-1), log_q.gather(-1, z)[:, 0],
         entropy], -1,
    )  # fmt: skip
    return (noised_p.argmax(-1, keepdim=True) == z).float()[:, 0], features


def previous_position_view(log_p, log_q) -> torch.Tensor:
    """[n, 3]: the target's entropy, top log probability and 1 - TV(p, q) one position back
    (zeros at the first position), known at a round's start when that position is the bonus;
    given here at every position, which overstates what a head could have."""
    p = log_p.exp()
    entropy = -(p * log_p.clamp(min=-80)).sum(-1)
    overlap = torch.minimum(p, log_q.exp()).sum(-1)
    view = torch.stack([entropy, log_p.amax(-1), overlap], -1)  # [n, 3]
    return torch.cat([torch.zeros(1, 3), view[:-1]])


def fit_logistic(x: torch.Tensor, y: torch.Tensor):
    """A logistic model on standardised features; returns x -> P(accept)."""
    mean, std = x.mean(0), x.std(0) + 1e-6
    weight = torch.zeros(x.shape[1], requires_grad=True)
    bias = torch.zeros((), requires_grad=True)
    opt = torch.optim.LBFGS([weight, bias], max_iter=500)
    scaled = (x - mean) / std

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(scaled @ weight + bias, y)
        loss.backward()
        return loss

    opt.step(closure)
    return lambda z: torch.sigmoid(((z - mean) / std) @ weight + bias).detach()


def cross_fitted(features: list[torch.Tensor], labels: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each prompt scored by a model fitted on the prompts of the other parity."""
    out: list[torch.Tensor] = []
    models = []
    for parity in (0, 1):
        train = [i for i in range(len(labels)) if i % 2 != parity]
        x = torch.cat([features[i] for i in train])
        models.append(fit_logistic(x, torch.cat([labels[i] for i in train])))
    for i, f in enumerate(features):
        out.append(models[i % 2](f))
    return out


def replay(labels: list[float], accept: list[float] | None, k: int | None, h: float | None):
    """Rounds along one text -> (tokens committed, cost in target steps). A constant drafts k;
    the head drafts until 1 - prod P(accept) > h (1..12)."""
    n, start, tokens, cost = len(labels), 0, 0, 0.0
    while start < n:
        room = min(len(VERIFY), n - start)
        if k is not None:
            drafted = min(k, room)
        else:
            drafted, log_all = 0, 0.0
            while drafted < room:
                log_all += math.log(max(accept[start + drafted], 1e-9))
                drafted += 1
                if -math.expm1(log_all) > h:
                    break
        kept = 0
        while kept < drafted and labels[start + kept] == 1:
            kept += 1
        step = min(kept + 1, n - start)
        cost += DRAFT_PRICE * drafted + VERIFY[drafted - 1]
        tokens, start = tokens + step, start + step
    return tokens, cost


def speeds(
    labels: list[torch.Tensor], accept: list[torch.Tensor]
) -> tuple[float, int, float, float]:
    """(best constant's tokens per target step, its k, the head's at its best h, that h)."""

    def speed(k=None, h=None) -> float:
        parts = [replay(y.tolist(), a.tolist(), k, h) for y, a in zip(labels, accept, strict=True)]
        return sum(t for t, _ in parts) / sum(c for _, c in parts)

    constants = {k: speed(k=k) for k in range(1, len(VERIFY) + 1)}
    heads = {h: speed(h=h) for h in THRESHOLDS}
    k = max(constants, key=constants.get)
    h = max(heads, key=heads.get)
    return constants[k], k, heads[h], h


def variant(laws, verdicts, extra=None, drafter_temperature: float = TEMPERATURE):
    """Mean over draws of (acceptance, held-out AUC, best constant, head, its gain, the gain of
    a head that knew the verdicts), and each draw's best k, best h and head's gain."""
    gen = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(DRAWS):
        labels, features = [], []
        for log_p, log_q in laws:
            log_p = log_p.log_softmax(-1)  # over the kept tokens
            log_q = (log_q * (TEMPERATURE / drafter_temperature)).log_softmax(-1)
            y, f = verdicts(log_p, log_q, gen)
            if extra is not None:
                f = torch.cat([f, extra(log_p, log_q)], -1)
            labels.append(y)
            features.append(f)
        accept = cross_fitted(features, labels)
        const, k, head, h = speeds(labels, accept)
        known = speeds(labels, labels)[2]  # stops right after the first rejected token
        rows.append((float(torch.cat(labels).mean()), auc(torch.cat(accept), torch.cat(labels)),
                     const, head, head / const - 1, known / const - 1, k, h))  # fmt: skip
    mean = [sum(r[i] for r in rows) / len(rows) for i in range(6)]
    return mean, [r[6] for r in rows], [r[7] for r in rows], [f"{r[4]:+.1%}" for r in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=12, help="prompts per set")
    default_cache = Path.home() / ".cache/specdecode/predictability/laws.pt"
    parser.add_argument("--cache", type=Path, default=default_cache)
    args = parser.parse_args()
    data = torch.load(args.cache) if args.cache.exists() else collect(args.prompts, args.cache)
    print(f"{DRAWS} verdict draws per position; a drafted token {DRAFT_PRICE} steps; verify "
          f"{' / '.join(map(str, VERIFY))} steps for 1..{len(VERIFY)} drafted")  # fmt: skip
    print(
        "| set | how tokens are drafted and verified | acceptance | held-out AUC | best "
        "constant (tokens/step) | head, best h | head vs best constant | verdicts known | per "
        "draw: k / h / gain |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, laws in data.items():
        for label, verdicts, extra, cold in (
            ("Leviathan's rule (shipped)", standard_verdicts, None, TEMPERATURE),
            ("shared Gumbel noise, head reads the noised law", gumbel_verdicts, None, TEMPERATURE),
            ("Leviathan's rule, drafter at T_d = 0.5", standard_verdicts, None, 0.5),
            ("Leviathan's rule + target's view one position back", standard_verdicts,
             previous_position_view, TEMPERATURE),
        ):  # fmt: skip
            (acc, score, const, head, gain, known), ks, hs, gains = variant(
                laws, verdicts, extra, cold
            )
            print(f"| {name} | {label} | {acc:.3f} | {score:.3f} | {const:.3f} | {head:.3f} | "
                  f"{gain:+.1%} | {known:+.1%} | {ks} / {hs} / {gains} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
