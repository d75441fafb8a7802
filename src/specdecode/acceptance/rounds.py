"""On-policy training data for the acceptance head: states recorded inside real speculative rounds.

The mixed collection (`head_data`) commits the drafter's token at only 15% of positions, so the
head mostly sees states whose prefix is the target's own text. At inference it is asked about
the k-th token of a round, whose prefix holds k - 1 drafted tokens. Measured on the default pair
at T = 0.7, the shipped sampling head ranks the tokens of real rounds as well as those of its
collection, but predicts lower there (mean 0.73 against a true 0.88) and so stops rounds early.

Here the engine itself decodes, on either backend (`ModelBackend`: PyTorch or llama.cpp), with
a constant policy drafting `rounds` tokens a round; two wrappers around the protocols record what
the head needs and what verification said:
* `RecordingPolicy` wraps the length policy and, after every drafted position, keeps the
  drafter's hidden state, the drafting law's features and the drawn token (what `HeadLength`
  reads there);
* `RecordingRule` wraps the verification rule and, before the verdict, labels every drafted
  token from the target logits of the same pass: argmax agreement, the expected acceptance
  sum_x min(p, q) and the drawn token's min(1, p/q).

Every drafted token is labelled, also those after the first rejection: the head judges each
token before any verdict, so those states are ones it meets too. The committed text is the
engine's output, so it follows the target's law; nothing is mixed. Each example also records
its round and its slot in the round, so `head train` can replay any stopping rule round by round
(`head_replay.preview_rounds`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdecode.acceptance.head import law_features
from specdecode.acceptance.labels import acceptance_labels
from specdecode.backends.base import ModelBackend
from specdecode.core.config import DecodeConfig, SamplingConfig
from specdecode.core.drafting.model import ModelDrafter
from specdecode.core.engine import decode
from specdecode.core.length_policies import ConstantLength, DraftedPosition, LengthPolicy
from specdecode.core.sampling import logits_to_probs
from specdecode.core.verification import Verdict, VerificationRule, drafted_mask, make_rule


@dataclass
class _Step:
    """What one round recorded, before the engine says which prompts its rows are."""

    positions: list[dict[str, torch.Tensor]] = field(default_factory=list)  # per slot, [batch, ...]
    labels: dict[str, torch.Tensor] | None = None  # [batch, k] each
    num_drafted: torch.Tensor | None = None  # [batch]


class RoundRecorder:
    """Collects the examples of every round; `flush` ties a round's rows to their prompts."""

    def __init__(self, sampling: SamplingConfig) -> None:
        self.sampling = sampling
        self.step = _Step()
        self.examples: dict[str, list[torch.Tensor]] = {}
        self.rounds = 0
        self.committed: dict[int, int] = {}  # tokens committed so far, per prompt

    def record_position(self, position: DraftedPosition) -> None:
        if position.hidden is None or position.token is None:
            raise ValueError("recording a round needs the drafter's hidden state and token")
        law_greedy = law_features(position.logits.float().softmax(-1))  # [batch, 3]
        law_sampling = law_greedy if position.probs is None else law_features(position.probs)
        self.step.positions.append(
            {
                "hidden": position.hidden.half().cpu(),  # [batch, hidden]
                "law_greedy": law_greedy.cpu(),
                "law_sampling": law_sampling.cpu(),
                "proposal": position.token.cpu(),  # [batch]
                "q_argmax": position.logits.argmax(-1).cpu(),  # [batch]
            }
        )

    def record_verify(self, draft_tokens, draft_probs, target_logits, num_drafted) -> None:
        k = draft_tokens.shape[1]
        if k == 0:  # a round that drafted nothing (the budget's last token)
            return
        positions = self.step.positions[:k]
        p_logits = target_logits[:, :k].float()  # [batch, k, vocab]
        q_argmax = torch.stack([p["q_argmax"] for p in positions], 1)  # [batch, k]
        greedy = (q_argmax == p_logits.argmax(-1).cpu()).float()
        top_log_prob = torch.stack([p["law_greedy"][:, 0] for p in positions], 1)  # [batch, k]
        p_law = q_law = None  # greedy rounds: the drawn token is the argmax
        if draft_probs is not None:  # the laws stay where the models run
            p_law = logits_to_probs(p_logits, self.sampling)  # [batch, k, vocab]
            q_law = draft_probs.float()
        device = draft_tokens.device
        labels = acceptance_labels(
            greedy.to(device), p_law, q_law, draft_tokens, top_log_prob.to(device)
        )  # [batch, k] each
        names = ("label_sampling", "label_drawn", "drawn_log_prob")
        self.step.labels = {"label_greedy": greedy} | {
            name: label.cpu() for name, label in zip(names, labels, strict=True)
        }
        self.step.num_drafted = num_drafted.cpu()

    def flush(self, prompt_rows: list[int], new_tokens: list[list[int]]) -> None:
        """The round just verified belonged to `prompt_rows` (one per batch row), which
        committed `new_tokens`; file its examples under those prompts."""
        step, self.step = self.step, _Step()
        if step.labels is None or step.num_drafted is None or not step.positions:
            return  # a round that drafted nothing (the budget's last token)
        k = step.labels["label_greedy"].shape[1]
        per_slot = {
            key: torch.stack([p[key] for p in step.positions[:k]], 1)
            for key in step.positions[0]
            if key != "q_argmax"
        }  # [batch, k, ...]
        keep = drafted_mask(step.num_drafted, k)  # [batch, k]
        prompt = torch.tensor(prompt_rows)[:, None].expand(-1, k)  # [batch, k]
        start = torch.tensor([self.committed.get(r, 0) for r in prompt_rows])[:, None]
        slot = torch.arange(k)[None, :].expand(len(prompt_rows), -1)  # [batch, k]
        round_id = self.rounds + torch.arange(len(prompt_rows))[:, None].expand(-1, k)
        columns = {
            **per_slot,
            **step.labels,
            "prompt_index": prompt,
            "position": start + slot,  # where the drafted token would sit in the response
            "round": round_id,
            "slot": slot,
        }
        for key, value in columns.items():
            self.examples.setdefault(key, []).append(value[keep])
        self.rounds += len(prompt_rows)
        for row, tokens in zip(prompt_rows, new_tokens, strict=True):
            self.committed[row] = self.committed.get(row, 0) + len(tokens)

    def result(self) -> dict[str, torch.Tensor]:
        if not self.examples:
            raise ValueError("no round drafted a token; collect with more prompts or tokens")
        return {key: torch.cat(parts) for key, parts in self.examples.items()}


class RecordingPolicy:
    """A length policy that also records, after each drafted position, what a head reads."""

    stops_early = True  # the drafter then reports every position, with its hidden state
    needs_hidden = True
    needs_number = False

    def __init__(self, inner: LengthPolicy, recorder: RoundRecorder) -> None:
        self.inner, self.recorder, self.name = inner, recorder, inner.name

    def start(self, batch_size: int, device: torch.device) -> None:
        self.inner.start(batch_size, device)

    def round_limits(self, max_tokens: torch.Tensor) -> torch.Tensor:
        return self.inner.round_limits(max_tokens)

    def keep_drafting(self, position: DraftedPosition) -> torch.Tensor:
        self.recorder.record_position(position)
        return self.inner.keep_drafting(position)

    def observe(self, num_drafted: torch.Tensor, num_accepted: torch.Tensor) -> None:
        self.inner.observe(num_drafted, num_accepted)

    def select_rows(self, rows: torch.Tensor) -> None:
        self.inner.select_rows(rows)


class RecordingRule:
    """A verification rule that labels every drafted token before passing the verdict on."""

    def __init__(self, inner: VerificationRule, recorder: RoundRecorder) -> None:
        self.inner, self.recorder = inner, recorder
        self.name, self.exact = inner.name, inner.exact

    def verify(self, draft_tokens, draft_probs, target_logits, num_drafted, rng) -> Verdict:
        self.recorder.record_verify(draft_tokens, draft_probs, target_logits, num_drafted)
        return self.inner.verify(draft_tokens, draft_probs, target_logits, num_drafted, rng)


def collect_rounds(
    target: ModelBackend,
    drafter: ModelBackend,
    prompts: list[list[int]],
    round_tokens: int,
    temperature: float,
    max_new_tokens: int,
    stop_ids: tuple[int, ...],
    row_seeds: tuple[int, ...],
) -> dict[str, torch.Tensor]:
    """Decode `prompts` as one batch with rounds of `round_tokens`, recording every drafted token.

    Returns hidden [n, hidden], law_greedy / law_sampling [n, 3] and, each [n]: the three labels,
    drawn_log_prob, proposal, prompt_index (row of `prompts`), position, round (within this
    call) and slot.
    """
    sampling = SamplingConfig(temperature)
    cfg = DecodeConfig(
        max_new_tokens=max_new_tokens,
        num_draft_tokens=round_tokens,
        drafting="model",  # the recording drafter, k tokens a round
        sampling=sampling,
        stop_token_ids=stop_ids,
        row_seeds=row_seeds,
    )
    recorder = RoundRecorder(sampling)
    vocab = target.vocab_size
    policy = RecordingPolicy(ConstantLength(round_tokens), recorder)
    model_drafter = ModelDrafter(drafter, sampling, vocab, policy)
    rule = RecordingRule(make_rule(None, sampling), recorder)
    for event in decode(target, model_drafter, rule, prompts, cfg):
        recorder.flush(event.rows, event.new_tokens)
    return recorder.result()
