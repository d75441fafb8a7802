"""Training data for the acceptance head: drafter states and the target's verdict on them.

Following SpecDec++, each response is a *mixed* sequence: at every position the target's own
token is committed, except with probability `mixing_ratio` (0.15 by default) the drafter's
proposal is committed instead. At inference the head is asked about states whose prefix already
holds drafted tokens (every position after the first of a round), so it must see such states in
training; a pure target-generated sequence would never show it one.

All of it happens in a single batched pass, both models stepping together with their caches: at
each position the target's logits p and the drafter's logits q and last hidden state h are at
hand, the drafter's proposal z is drawn from q, and the labels are what verification would say
about z there. Then the next committed token is z (with probability `mixing_ratio`) or the
target's own y. No second labelling pass over the text is needed.

Two labels are recorded per position, so one collection serves heads for both rules:
* `label_greedy`: 1 if argmax q == argmax p (greedy verification accepts the drafted token);
* `label_sampling`: sum_x min(p_T(x), q_T(x)), the exact probability that lossless speculative
  sampling at temperature T accepts a token drawn from q_T. We record this expectation rather
  than min(1, p/q) of the one token drawn, or the sampled accept/reject outcome: all three have
  the same mean given the state, and this one has zero sampling variance, so the head learns the
  same function from fewer examples. (At T = 0 it equals the greedy label.)

A third label is about the one token z the drafter drew there from q_T (the `proposal`):
* `label_drawn`: min(1, p_T(z) / q_T(z)), the probability that lossless speculative sampling
  accepts *that* token, with `drawn_log_prob` = log q_T(z) beside it. A policy deciding after z
  is drawn knows z, so a head may condition on it: its mean over z is `label_sampling`, but it
  tells a round that drew a likely token from one that drew from the tail. (Under greedy, z is
  the argmax and this is the greedy label.)

Beside the hidden state, each position records `law_features` (log top probability, entropy,
log top-2 margin) of the drafter's law: `law_greedy` from softmax(q), what a greedy round drafts
from, and `law_sampling` from the temperature-T law a sampled round draws from.

With `rounds` = k > 0 the examples come instead from real decoding, inside rounds of k drafted
tokens (`head_rounds`): the states the head meets at inference, with no mixing. Both kinds have
the same tensors; rounds also record each example's round and slot.

Both models are `ModelBackend`s (a `transformers` module is wrapped in the PyTorch backend), so
a collection runs on either backend: on llama.cpp the hidden state is the drafter's final norm
output as llama.cpp computes it from the GGUF, the state `transformers` returns for the GGUF's
fp32 conversion, and the pair's identity is the conversion's (`model_identity`), so a head
trained on one backend's states is admitted on the other's (`acceptance.head` says why that is
sound). The collection's `meta.json` names the backend, and a collection resumes only on the
backend it began on.

Collection is written in shards, one per batch of prompts, and resumes where it stopped; under
`accelerate launch` the processes share out the shards and the main process writes them all.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from specdecode.acceptance.examples import EXAMPLES_FILE, META_FILE
from specdecode.acceptance.head import IDENTITY_ROWS, ModelIdentity, law_features
from specdecode.acceptance.labels import acceptance_labels
from specdecode.backend_names import LLAMA_CPP, TORCH
from specdecode.backends.base import ModelBackend
from specdecode.backends.llamacpp import LlamaCppModel
from specdecode.backends.torch_eager import CachedModel
from specdecode.core.config import SamplingConfig
from specdecode.core.drafting.model import align_vocab
from specdecode.core.sampling import logits_to_probs
from specdecode.training.distributed import gather_objects, main_object, process_state


@dataclass(frozen=True)
class CollectConfig:
    max_new_tokens: int = 96
    temperature: float = 0.7  # the target's responses and the sampling labels; 0 = greedy
    mixing_ratio: float = 0.15
    batch_size: int = 8
    seed: int = 0
    rounds: int = 0  # > 0: record inside real rounds of this many drafted tokens (`head_rounds`)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0.0 <= self.mixing_ratio <= 1.0:
            raise ValueError(f"mixing_ratio must be in [0, 1], got {self.mixing_ratio}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.rounds < 0:
            raise ValueError(f"rounds must be >= 0 (0: mixed sequences), got {self.rounds}")
        if self.rounds and self.mixing_ratio:
            raise ValueError(
                "a collection inside real rounds commits the verified tokens, so it mixes "
                f"nothing: mixing_ratio must be 0 with rounds, got {self.mixing_ratio}"
            )
        SamplingConfig(self.temperature)  # validates the temperature


def _draw(logits: torch.Tensor, law: torch.Tensor | None, gen: torch.Generator) -> torch.Tensor:
    """logits [batch, vocab], the sampling law [batch, vocab] (None under greedy) -> [batch]."""
    if law is None:
        return logits.argmax(-1)
    return torch.multinomial(law, 1, generator=gen)[:, 0]


@torch.no_grad()
def collect_batch(
    target: ModelBackend,
    drafter: ModelBackend,
    prompts: list[list[int]],
    cfg: CollectConfig,
    stop_ids: tuple[int, ...],
    gen: torch.Generator,
) -> dict[str, torch.Tensor]:
    """Mixed responses for a batch of prompts, with a labelled example at every position."""
    sampling = SamplingConfig(cfg.temperature)
    batch, width = len(prompts), max(map(len, prompts))
    device = target.device
    tokens = torch.zeros(batch, width, dtype=torch.long, device=device)
    valid = torch.zeros(batch, width, dtype=torch.bool, device=device)
    for row, prompt in enumerate(prompts):  # left-padded with holes
        tokens[row, width - len(prompt) :] = torch.tensor(prompt, device=device)
        valid[row, width - len(prompt) :] = True
    target.reset(batch)
    drafter.reset(batch)
    vocab = target.vocab_size
    stops = torch.tensor(stop_ids, dtype=torch.long, device=device)
    alive = torch.ones(batch, dtype=torch.bool, device=device)  # [batch]
    keys = ("hidden", "greedy", "soft", "law_greedy", "law_sampling", "row", "position")
    keys += ("proposal", "token", "mixed", "label_drawn", "drawn_log_prob")
    records: dict[str, list[torch.Tensor]] = {k: [] for k in keys}
    for step in range(cfg.max_new_tokens):
        p_logits, _ = target.forward(tokens, valid, 1)
        q_logits, hidden = drafter.forward(tokens, valid, 1, want_hidden=True)
        p_logits = p_logits[:, -1].float()  # [batch, vocab]
        q_logits = align_vocab(q_logits[:, -1].float(), vocab)  # [batch, vocab]
        greedy = (q_logits.argmax(-1) == p_logits.argmax(-1)).float()  # [batch]
        law_greedy = law_features(q_logits.softmax(-1))  # [batch, 3]
        p_law = q_law = None  # the sampling laws [batch, vocab], computed once per step
        if sampling.greedy:
            law_sampling = law_greedy
        else:
            p_law, q_law = logits_to_probs(p_logits, sampling), logits_to_probs(q_logits, sampling)
            law_sampling = law_features(q_law)  # [batch, 3]
        own, proposal = _draw(p_logits, p_law, gen), _draw(q_logits, q_law, gen)
        soft, drawn_label, drawn_log_prob = acceptance_labels(
            greedy, p_law, q_law, proposal, law_greedy[:, 0]
        )  # [batch] each
        rows = alive.nonzero()[:, 0]
        records["law_greedy"].append(law_greedy[rows].cpu())
        records["law_sampling"].append(law_sampling[rows].cpu())
        records["hidden"].append(hidden[rows, -1].half().cpu())
        records["greedy"].append(greedy[rows].cpu())
        records["soft"].append(soft[rows].cpu())
        records["row"].append(rows.cpu())
        records["position"].append(torch.full((len(rows),), step))
        records["label_drawn"].append(drawn_label[rows].cpu())
        records["drawn_log_prob"].append(drawn_log_prob[rows].cpu())
        mix = torch.rand(batch, generator=gen, device=device) < cfg.mixing_ratio
        nxt = torch.where(mix, proposal, own)  # [batch]
        records["proposal"].append(proposal[rows].cpu())
        records["token"].append(nxt[rows].cpu())
        records["mixed"].append(mix[rows].cpu())
        alive = alive & ~torch.isin(nxt, stops)
        if not bool(alive.any()):
            break
        tokens, valid = nxt[:, None], alive[:, None]
    out = {key: torch.cat(parts) for key, parts in records.items()}
    # hidden [n, hidden], law_* [n, 3]; every other entry [n]: row of the batch, position,
    # the drafter's proposal there, the token committed there, whether it was the proposal,
    # the proposal's acceptance probability and its log probability under the drafting law
    out["label_greedy"], out["label_sampling"] = out.pop("greedy"), out.pop("soft")
    return out


def model_identity(model: torch.nn.Module | ModelBackend) -> ModelIdentity:
    """Whose states a collection holds: a `transformers` model's identity, or on llama.cpp its
    GGUF's, which is the identity of the GGUF's fp32 conversion (the same weights: the same
    name and fingerprint, read from the file's first embedding rows, `ModelIdentity.of_rows`)."""
    if isinstance(model, CachedModel):
        model = model.model
    if isinstance(model, torch.nn.Module):
        return ModelIdentity.of(model)
    if isinstance(model, LlamaCppModel):
        from specdecode.models.cache import GGUF_FILE
        from specdecode.models.convert import gguf_identity_parts

        path = model.path  # a cached model.gguf is named by its folder, as its conversion is
        name = path.parent.name if path.name == GGUF_FILE else path.stem
        return ModelIdentity.of_rows(name, *gguf_identity_parts(path, IDENTITY_ROWS))
    raise TypeError(
        f"a head collection reads a transformers model or a llama.cpp model, got "
        f"{type(model).__name__}"
    )


def as_backend(model: torch.nn.Module | ModelBackend, role: str) -> ModelBackend:
    """A `transformers` module on the PyTorch backend; a backend as it is (as the API does;
    this package sits above the API but may not import it: the API imports the head)."""
    return CachedModel(model.eval(), role) if isinstance(model, torch.nn.Module) else model


def backend_name(lm: ModelBackend) -> str:
    """The backend whose drafter states a collection records: torch or llama.cpp."""
    return LLAMA_CPP if isinstance(lm, LlamaCppModel) else TORCH


def collect(
    target: torch.nn.Module | ModelBackend,
    drafter: torch.nn.Module | ModelBackend,
    prompts: list[list[int]],
    out_dir: str | Path,
    cfg: CollectConfig,
    stop_ids: tuple[int, ...],
    source: str = "",
    skip: int = 0,
    progress: bool = True,
) -> dict:
    """Collect into `out_dir` (resuming finished shards) and merge into one examples file.

    `target` and `drafter`: `transformers` modules (run on the PyTorch backend) or model
    backends (`LlamaCppModel`). `source` and `skip` name the prompts (the set, and how many of
    its first prompts were left out); a later call with the same settings resumes, and may ask
    for more or fewer prompts.

    Under `accelerate launch` the shards still to collect are dealt out to the processes in
    turn; each shard depends only on its prompts and its seed, so it is the shard one process
    collects. After each turn the main process gathers the turn's shards and writes them, and
    at the end it merges them, in order: the files are those of a single process, and nodes
    need no shared file system. Every process returns the same record.
    """
    from tqdm import tqdm

    state = process_state()
    main = state.is_main_process
    out = Path(out_dir)
    shards = out / "shards"
    target_lm, drafter_lm = as_backend(target, "target"), as_backend(drafter, "drafter")
    meta = {
        "drafter": asdict(model_identity(drafter_lm)),
        "target": asdict(model_identity(target_lm)),
        "backend": backend_name(drafter_lm),
        "prompts": source,
        "skip": skip,
        **asdict(cfg),
    }
    old = out / META_FILE
    if old.is_file():
        before = json.loads(old.read_text())
        if {k: before.get(k) for k in meta} != meta:
            raise ValueError(
                f"{out} holds a collection made with other settings or models; "
                "use a new --out directory or delete it"
            )
    meta["num_prompts"] = len(prompts)
    started = time.perf_counter()
    seconds = json.loads(old.read_text()).get("seconds", 0.0) if old.is_file() else 0.0
    starts = range(0, len(prompts), cfg.batch_size)
    todo: list[int] = []
    if main:  # the shards on the writer's disk are the truth
        shards.mkdir(parents=True, exist_ok=True)
        todo = [n for n in range(len(starts)) if not (shards / f"{n:05d}.safetensors").is_file()]
    todo = main_object(state, todo)
    bar = tqdm(total=len(todo), desc="collect", unit="batch", disable=not progress or not main)
    for turn in range(0, len(todo), state.num_processes):
        mine = todo[turn : turn + state.num_processes]
        n = mine[state.process_index] if state.process_index < len(mine) else None
        part = None if n is None else _collect_shard(n, starts[n], prompts, cfg, stop_ids,
                                                     target_lm, drafter_lm)  # fmt: skip
        for got in gather_objects(state, (n, part)):
            if main and got[0] is not None:
                save_file(got[1], shards / f"{got[0]:05d}.safetensors")
        if main:
            meta["seconds"] = seconds + time.perf_counter() - started
            old.write_text(json.dumps(meta, indent=1) + "\n")
        bar.update(len(mine))
    bar.close()
    if main:
        parts = [load_file(shards / f"{n:05d}.safetensors") for n in range(len(starts))]
        merged = {key: torch.cat([p[key] for p in parts]) for key in parts[0]}
        save_file(merged, out / EXAMPLES_FILE)
        meta["num_examples"] = len(merged["label_greedy"])
        meta["mean_label_greedy"] = float(merged["label_greedy"].mean())
        meta["mean_label_sampling"] = float(merged["label_sampling"].mean())
        meta["mean_label_drawn"] = float(merged["label_drawn"].mean())
        meta["seconds"] = seconds + time.perf_counter() - started
        old.write_text(json.dumps(meta, indent=1) + "\n")
    meta = main_object(state, meta)
    state.wait_for_everyone()
    return meta


def _collect_shard(
    n: int,
    start: int,
    prompts: list[list[int]],
    cfg: CollectConfig,
    stop_ids: tuple[int, ...],
    target_lm: ModelBackend,
    drafter_lm: ModelBackend,
) -> dict[str, torch.Tensor]:
    """Shard `n`: the prompts from `start` on, one batch; a function of them and the seed alone."""
    batch = prompts[start : start + cfg.batch_size]
    if cfg.rounds:
        from specdecode.acceptance.rounds import collect_rounds

        seeds = tuple(cfg.seed * 1_000_003 + start + i for i in range(len(batch)))
        part = collect_rounds(
            target_lm,
            drafter_lm,
            batch,
            cfg.rounds,
            cfg.temperature,
            cfg.max_new_tokens,
            stop_ids,
            seeds,
        )
        part["round"] += n * cfg.batch_size * cfg.max_new_tokens  # unique over shards
        part["prompt_index"] += start  # index among the prompts after `skip`
    else:
        gen = torch.Generator(device=target_lm.device).manual_seed(cfg.seed * 1_000_003 + n)
        part = collect_batch(target_lm, drafter_lm, batch, cfg, stop_ids, gen)
        part["prompt_index"] = part.pop("row") + start  # index among the prompts after `skip`
    return part
