"""Stand-ins for the engine's row interface until it lands (removed then)."""

from __future__ import annotations

from dataclasses import dataclass, field

from specdecode.core.config import SamplingConfig


@dataclass(frozen=True)
class RowRequest:
    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class RowUpdate:
    key: int
    tokens: list[int]
    finished: bool
    drafted: int
    accepted: int
    reused: int


class RowFailed(Exception):
    def __init__(self, key: int, message: str) -> None:
        super().__init__(message)
        self.key = key
        self.message = message
