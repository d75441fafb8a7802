"""The acceptance head of SpecDec++ (Huang et al., 2024): P(target accepts this drafted token).

A small residual MLP on the drafter's last hidden state (after its final norm) at the position
that produced the drafted token. Each layer has its own weights (`nn.ModuleList` of distinct
blocks); the seed's code repeats one block object, which ties every layer to the same weights.

Beside the hidden state the head reads three numbers about the law the token was drafted from
(`law_features`: log top probability, entropy, log margin between the top two). The hidden state
holds them only through the drafter's output layer (a 151k-way projection for Qwen), which a
small head trained on a few thousand examples cannot learn again: measured on the default pair's
collection, the drafter's top probability alone ranks greedy acceptance with AUC 0.925, against
0.809 for a head on the hidden state alone. The law is at hand anyway when a token is drafted,
so the features cost a top-2 and an entropy per drafted token.

A sampling head may also read the log probability of the token actually drawn
(`HeadConfig.drawn_token`). Lossless sampling accepts a drawn token z with probability
min(1, p(z)/q(z)), and z is known when the policy decides whether to draft on, so such a head
learns the acceptance of z itself rather than its average over the law: a round that drew a
token from the law's tail is told apart from one that drew its mode. (Under greedy the drawn
token is the argmax and the feature repeats the top probability, so greedy heads leave it out.)

A head is only meaningful for the drafter whose states it reads and the target whose verdicts it
learnt, so the saved config names both (a readable name and a weight fingerprint) and `load_head`
refuses a head trained for another pair. It also records the verification rule of its labels:
greedy labels (argmax agreement) and sampling labels (expected acceptance) are different targets.

The identity is the weights', not the backend's: a GGUF on llama.cpp has the identity of its
fp32 conversion on torch (`ModelIdentity.of_rows`), so a head trained on one backend's states
loads on the other's, and the collection it was trained on records which backend that was
(`meta.json`'s `backend`, kept in `training.json`). Admitted, not refused, because the states
are the same quantity: llama.cpp's embeddings output is the final norm's output, as the last
hidden state of `transformers` is, computed from the same weights; what differs is llama.cpp's
quantized arithmetic. Measured on SmolLM2-135M (Q8_0, HumanEval prompts), the two backends'
states differ by 2-3% of their norm (cosine >= 0.997), where neighbouring positions' states
differ by 65-70%; the law features differ as little (the top probability by 0.01 at the
median). A head is a function of the state smooth at that scale, trained with dropout.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

CONFIG_FILE = "head_config.json"
WEIGHTS_FILE = "head.safetensors"
RULES = ("greedy", "sampling")
LAW_FEATURES = ("log top probability", "entropy", "log margin top-1 / top-2")
DRAWN_FEATURE = "log probability of the drawn token"
_MAX_MARGIN = 30.0  # a filtered law (top-k = 1) has a zero runner-up: cap its log margin
IDENTITY_ROWS = 8  # the input embedding's rows a model's fingerprint reads
ModelSizes = tuple[str, int, int, int]  # model type, vocabulary, hidden size, layers
SHIPPED_DIR = (
    Path(__file__).parent.parent / "heads"
)  # heads trained by the project for default pairs


def top_two(values: torch.Tensor, chunk: int = 128) -> torch.Tensor:
    """values [..., n] -> [..., 2] the two largest, descending: the values of `topk(2)`.

    The policy takes them once per drafted token over the whole vocabulary, where `topk` on the
    CPU is most of the law features' time. The maxima of fixed chunks are one vectorised pass;
    the largest is the best chunk's maximum, and the runner-up is either the best chunk's
    second entry or the next chunk's maximum: several times faster than `topk` there.
    """
    n = values.shape[-1]
    whole = n - n % chunk
    if whole < 2 * chunk:
        return values.topk(2, dim=-1).values
    blocks = values[..., :whole].unflatten(-1, (whole // chunk, chunk))  # [..., C, chunk]
    maxima, best = blocks.amax(-1).topk(2, dim=-1)  # [..., 2] the two largest chunk maxima
    index = best[..., :1, None].expand(*best.shape[:-1], 1, chunk)  # [..., 1, chunk]
    inside = blocks.gather(-2, index).squeeze(-2).topk(2, dim=-1).values  # [..., 2]
    pair = torch.stack([inside[..., 0], torch.maximum(inside[..., 1], maxima[..., 1])], -1)
    if whole < n:  # the entries that fill no chunk
        pair = torch.cat([pair, values[..., whole:]], -1).topk(2, dim=-1).values
    return pair


def law_features(law: torch.Tensor, drawn: torch.Tensor | None = None) -> torch.Tensor:
    """law [..., vocab] probabilities (the law the token is drafted from) -> [..., 3] float32.

    With `drawn` [...] (the token drawn from it), a fourth column: its log probability.
    """
    law = law.float()
    top2 = top_two(law).clamp_min(1e-30).log()  # [..., 2]
    # p log p with p clamped inside the log: 0 log 0 = 0 as in xlogy, at a fifth of its time
    # over a 151k vocabulary (this runs once per drafted token)
    entropy = -(law * law.clamp_min(1e-30).log()).sum(-1)  # [...]
    margin = (top2[..., 0] - top2[..., 1]).clamp(max=_MAX_MARGIN)  # [...]
    columns = [top2[..., 0], entropy, margin]
    if drawn is not None:
        picked = law.gather(-1, drawn[..., None].to(law.device))[..., 0]  # [...]
        columns.append(picked.clamp_min(1e-30).log())
    return torch.stack(columns, dim=-1)


def number_logit(calibration, logit: torch.Tensor, number: torch.Tensor) -> torch.Tensor:
    """bias + a z + b log u: a head's logit z [N] and acceptance numbers u [N] -> [N].

    `calibration` is (bias, a, b), numbers or 0-d tensors (the fit passes its weights)."""
    bias, a, b = calibration
    return bias + a * logit + b * number.to(logit.dtype).clamp(min=1e-9).log()


class HeadMismatchError(ValueError):
    """The head was trained for another drafter, target or verification rule."""


@dataclass(frozen=True)
class ModelIdentity:
    """Who a head belongs to: a readable name and a fingerprint of the weights' first rows."""

    name: str
    fingerprint: str
    # the same weights in any precision: a model loaded in bfloat16 or float16 has other bytes,
    # but rounding keeps every sign (None in heads saved before it was recorded)
    signs: str | None = None

    @classmethod
    def of(cls, model: nn.Module) -> ModelIdentity:
        return cls(model_name(model), model_fingerprint(model), model_signs(model))

    @classmethod
    def of_rows(cls, name: str, sizes: ModelSizes, rows: torch.Tensor) -> ModelIdentity:
        """The identity of a model known by its sizes and its input embedding's first
        `IDENTITY_ROWS` rows ([rows, hidden], fp32), with no torch module: a GGUF file read as
        its conversion reads it (`models.convert.gguf_identity_parts`) gets the identity of its
        converted torch model, so a head is the same pair's on either backend."""
        return cls(name, _digest(sizes, rows.to(torch.float32)), _digest(sizes, rows > 0))

    def admits(self, model: nn.Module) -> bool:
        """Whether `model` is this one: the same fp32 bytes, or, loaded in lower precision
        (a GPU user's bfloat16), the same signs. A float32 model must match exactly."""
        if model_fingerprint(model) == self.fingerprint:
            return True
        low = model.get_input_embeddings().weight.dtype in (torch.bfloat16, torch.float16)
        return low and self.signs is not None and model_signs(model) == self.signs

    def __str__(self) -> str:
        return f"{self.name!r} (fingerprint {self.fingerprint})"


def model_name(model: nn.Module) -> str:
    path = getattr(model.config, "name_or_path", "") or getattr(model.config, "_name_or_path", "")
    return Path(path).name if path else type(model).__name__


def model_fingerprint(model: nn.Module) -> str:
    """Architecture sizes plus the input embedding's first rows (fp32 bytes).

    Embeddings are left alone by int8 dynamic quantization of the Linear layers, so the fp32
    drafter and its int8 copy share a fingerprint, as they share hidden states up to rounding.
    """
    return _digest(model_sizes(model), _first_rows(model).to(torch.float32))


def model_signs(model: nn.Module) -> str:
    """Architecture sizes plus the signs of the input embedding's first rows: what survives
    loading the same weights in bfloat16 or float16, where the fp32 bytes do not."""
    return _digest(model_sizes(model), _first_rows(model) > 0)


def model_sizes(model: nn.Module) -> ModelSizes:
    """(model type, vocabulary, hidden size, layers) of a `transformers` model."""
    config = model.config
    vocab, hidden = model.get_input_embeddings().weight.shape
    return (config.model_type, int(vocab), int(hidden), int(config.num_hidden_layers))


def _first_rows(model: nn.Module) -> torch.Tensor:
    return model.get_input_embeddings().weight.detach()[:IDENTITY_ROWS]


def _digest(sizes: ModelSizes, rows: torch.Tensor) -> str:
    """sizes, rows [IDENTITY_ROWS, hidden] (fp32 values or bool signs) -> 16 hex digits."""
    digest = hashlib.sha256()
    digest.update(repr(tuple(sizes)).encode())
    values = rows.to(torch.float32 if rows.is_floating_point() else torch.uint8)
    digest.update(values.cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


@dataclass(frozen=True)
class HeadConfig:
    hidden_size: int
    num_layers: int = 3
    width: int | None = None  # the residual blocks' width: None runs them on the hidden state
    # itself; a smaller width first projects the state down (fewer weights to read per drafted
    # token, and fewer to fit on a few thousand examples)
    dropout: float = 0.1
    law_features: bool = True  # also read `law_features` of the drafting law (heads saved
    # before they existed have no such key and load with False)
    drawn_token: bool = False  # also read log q(z) of the drawn token z, and predict the
    # acceptance of z itself, min(1, p(z)/q(z)) (sampling heads)
    rule: str = "greedy"  # the verification rule whose acceptance the labels record
    temperature: float = 0.0  # the sampling temperature of the labels (rule "sampling")
    drafter: ModelIdentity | None = None
    target: ModelIdentity | None = None
    # sampling heads: (bias, a, b) of logit P(accept | z, u) = bias + a z + b log u, the head's
    # logit z combined with the token's acceptance number u (`with_number`, policy `head-u`)
    number_calibration: tuple[float, float, float] | None = None

    def __post_init__(self) -> None:
        if self.hidden_size < 1:
            raise ValueError(f"hidden_size must be >= 1, got {self.hidden_size}")
        if self.num_layers < 0:
            raise ValueError(f"num_layers must be >= 0, got {self.num_layers}")
        if self.width is not None and self.width < 1:
            raise ValueError(f"width must be >= 1 (or None: the hidden size), got {self.width}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.rule not in RULES:
            raise ValueError(f"rule must be one of {RULES}, got {self.rule!r}")
        if self.drawn_token and not self.law_features:
            raise ValueError("drawn_token needs law_features: it is a fourth law feature")
        if self.number_calibration is not None:
            if self.rule != "sampling":
                raise ValueError("only sampling verdicts have acceptance numbers to calibrate on")
            if len(self.number_calibration) != 3 or not all(
                math.isfinite(x) for x in self.number_calibration
            ):
                raise ValueError(
                    f"number_calibration must be three finite numbers (bias, head, log "
                    f"number), got {self.number_calibration!r}"
                )

    @property
    def num_features(self) -> int:
        """How many law features the head reads: 0, 3, or 4 with the drawn token's."""
        return (len(LAW_FEATURES) + self.drawn_token) if self.law_features else 0

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> HeadConfig:
        raw = json.loads(text)
        for role in ("drafter", "target"):
            if raw.get(role) is not None:
                raw[role] = ModelIdentity(**raw[role])
        raw.setdefault("law_features", False)
        raw.setdefault("drawn_token", False)
        raw.setdefault("width", None)
        if raw.get("number_calibration") is not None:
            raw["number_calibration"] = tuple(raw["number_calibration"])
        return cls(**raw)


class ResidualBlock(nn.Module):
    def __init__(self, width: int, dropout: float) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.dropout(nn.functional.silu(self.linear(x)))


class AcceptanceHead(nn.Module):
    """hidden [..., hidden_size] (+ law features [..., F]) -> acceptance logit [...].

    With `HeadConfig.width` set, a linear layer first projects the state to that width and the
    residual blocks run there.

    With law features the logit is a logistic term on the standardised features plus the
    residual MLP's term on the hidden state. The MLP's output layer starts at zero, so a head
    begins as the logistic model on the law and the MLP learns what the hidden state adds
    (`head_train` fits the two in that order and keeps whichever epoch validates best).
    """

    def __init__(self, config: HeadConfig) -> None:
        super().__init__()
        self.config = config
        width = config.width or config.hidden_size
        # [..., hidden_size] -> [..., width]; absent when the blocks run on the state itself
        self.project = nn.Linear(config.hidden_size, width) if config.width else None
        self.blocks = nn.ModuleList(
            ResidualBlock(width, config.dropout) for _ in range(config.num_layers)
        )
        self.out = nn.Linear(width, 1)
        if config.law_features:
            n = config.num_features
            self.law = nn.Linear(n, 1)
            # the features' scale on the training data, saved with the weights
            self.register_buffer("law_mean", torch.zeros(n))
            self.register_buffer("law_std", torch.ones(n))
            nn.init.zeros_(self.out.weight)
            nn.init.zeros_(self.out.bias)

    @property
    def reads_law(self) -> bool:
        """Whether `forward` needs `law_features` of the drafting law beside the hidden state."""
        return self.config.law_features

    @property
    def reads_drawn(self) -> bool:
        """Whether those features include the drawn token's (`law_features(law, drawn)`)."""
        return self.config.drawn_token

    def law_term(self, features: torch.Tensor) -> torch.Tensor:
        """features [..., F] -> the logistic term on the standardised features [...]."""
        scaled = (features.to(self.law_mean.dtype) - self.law_mean) / self.law_std
        return self.law(scaled.to(self.law.weight.dtype)).squeeze(-1)

    def forward(self, hidden: torch.Tensor, features: torch.Tensor | None = None) -> torch.Tensor:
        x = hidden.to(self.out.weight.dtype)
        if self.project is not None:
            x = self.project(x)
        for block in self.blocks:
            x = block(x)
        logit = self.out(x).squeeze(-1)
        if not self.reads_law:
            return logit
        want = self.config.num_features
        if features is None or features.shape[-1] != want:
            got = "none" if features is None else f"{features.shape[-1]}"
            raise ValueError(
                f"this acceptance head reads {want} features of the drafting law "
                f"(`law_features`{', with the drawn token' if self.reads_drawn else ''}) "
                f"beside the hidden state; got {got}"
            )
        return logit + self.law_term(features).to(logit.dtype)

    def with_number(self, logit: torch.Tensor, number: torch.Tensor) -> torch.Tensor:
        """logit [batch] of this head, number [batch] in [0, 1) -> logit of P(accept | u).

        The verdict is u < min(1, p/q); the head knows p/q only in expectation, so the chance
        of acceptance falls with u, which the fitted calibration says by how much.
        """
        if self.config.number_calibration is None:
            raise ValueError("this head has no number calibration (`specdecode head calibrate`)")
        return number_logit(self.config.number_calibration, logit, number)

    @torch.no_grad()
    def acceptance(
        self, hidden: torch.Tensor, features: torch.Tensor | None = None
    ) -> torch.Tensor:
        """hidden [batch, hidden_size], features [batch, F] -> P(accepted) [batch]."""
        return torch.sigmoid(self(hidden, features))

    def save(self, directory: str | Path, dtype: torch.dtype | None = None) -> Path:
        """Weights as safetensors (in `dtype` if given: fp16 halves a shipped head) + config."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tensors = {
            name: t.detach().to(dtype or t.dtype).contiguous().cpu()
            for name, t in self.state_dict().items()
        }
        save_file(tensors, directory / WEIGHTS_FILE)
        (directory / CONFIG_FILE).write_text(self.config.to_json() + "\n")
        return directory


def load_head(
    directory: str | Path,
    drafter: nn.Module | None = None,
    target: nn.Module | None = None,
    rule: str | None = None,
) -> AcceptanceHead:
    """Load a saved head; refuse it if it was trained for another drafter, target or rule."""
    directory = Path(directory)
    config_path = directory / CONFIG_FILE
    if not config_path.is_file():
        raise FileNotFoundError(
            f"no acceptance head at {directory} (expected {CONFIG_FILE} and {WEIGHTS_FILE}); "
            "train one with `specdecode head collect` and `specdecode head train`"
        )
    config = HeadConfig.from_json(config_path.read_text())
    for role, model in (("drafter", drafter), ("target", target)):
        trained_for = getattr(config, role)
        if model is None or trained_for is None:
            continue
        if not trained_for.admits(model):
            given = ModelIdentity.of(model)
            raise HeadMismatchError(
                f"acceptance head {directory} was trained for the {role} {trained_for}, "
                f"but the {role} given is {given}; collect and train a head for this pair "
                "(`specdecode head collect`, then `specdecode head train`)"
            )
    if rule is not None and rule != config.rule:
        raise HeadMismatchError(
            f"acceptance head {directory} learnt {config.rule} acceptance, but decoding uses "
            f"{rule} verification; train a head with `specdecode head train --rule {rule}`"
        )
    head = AcceptanceHead(config)
    head.load_state_dict(load_file(directory / WEIGHTS_FILE))
    return head.eval()


def head_provenance(directory: str | Path) -> dict:
    """What a benchmark record keeps of the head it measured: where it was, the SHA-256 of its
    weights and its config, so a figure can be traced to the exact head after it is retrained."""
    directory = Path(directory)
    weights = directory / WEIGHTS_FILE
    if not weights.is_file():
        raise FileNotFoundError(f"no acceptance head weights at {weights}")
    return {
        "dir": str(directory),
        "sha256": hashlib.sha256(weights.read_bytes()).hexdigest(),
        "config": json.loads((directory / CONFIG_FILE).read_text()),
    }


def find_shipped_head(drafter: nn.Module, target: nn.Module, rule: str) -> Path | None:
    """A head shipped with the package for exactly this drafter, target and rule, if any."""
    for config_path in sorted(SHIPPED_DIR.glob(f"*/{CONFIG_FILE}")):
        config = HeadConfig.from_json(config_path.read_text())
        if config.drafter is None or config.target is None or config.rule != rule:
            continue
        if config.drafter.admits(drafter) and config.target.admits(target):
            return config_path.parent
    return None
