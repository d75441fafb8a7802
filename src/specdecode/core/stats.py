"""Statistics of a decoding call, per row and in total.

Names follow the field: a target call verifies one draft; *accepted* draft tokens, a *recovered*
token after a rejection, a *bonus* token when the whole draft was accepted. The mean number of
tokens committed per target call (often called tau, or MAT) and the acceptance rate alpha are
what the speedup bound of Leviathan et al. is written in (see `bench`).
"""

from __future__ import annotations

from dataclasses import asdict, astuple, dataclass, field


@dataclass
class RowStats:
    target_calls: int = 0
    drafter_calls: int = 0
    drafted: int = 0
    accepted: int = 0
    recovered: int = 0
    bonus: int = 0
    new_tokens: int = 0
    accepted_hist: list[int] = field(default_factory=list)  # [n] = target calls accepting n
    # target calls of rounds that drafted (a plain round of a gated batch, or a row's last
    # token, drafts nothing: it sits in accepted_hist[0] but asked the drafter nothing)
    drafting_calls: int = 0

    def record(self, drafted: int, accepted: int, emitted: int, drafter_passes: int) -> None:
        """One round of this row. `drafter_passes`: one per drafted token for an autoregressive
        drafter, one per round for a block drafter. A stop token among the accepted drafts ends
        the row: the drafts after it were accepted but never emitted, so they do not count."""
        accepted = min(accepted, emitted)
        self.target_calls += 1
        self.drafting_calls += drafted > 0
        self.drafter_calls += drafter_passes
        self.drafted += drafted
        self.accepted += accepted
        if accepted < drafted:
            self.recovered += 1
        else:
            self.bonus += 1
        self.new_tokens += emitted
        if len(self.accepted_hist) <= accepted:
            self.accepted_hist.extend([0] * (accepted + 1 - len(self.accepted_hist)))
        self.accepted_hist[accepted] += 1

    @property
    def tokens_per_target_call(self) -> float:
        return self.new_tokens / self.target_calls if self.target_calls else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def accepted_at_least(self) -> list[float]:
        """[j - 1] = share of the target calls that drafted which accepted at least j drafted
        tokens.

        Why: a draft is accepted up to its first miss, so these shares say where rounds end;
        the first one, the acceptance of a round's first drafted token, bounds every later one.
        """
        calls, hist = self.drafting_calls, self.accepted_hist
        if not calls:
            return []
        return [sum(hist[j:]) / calls for j in range(1, len(hist))]

    def merge(self, other: RowStats) -> RowStats:
        hist = [0] * max(len(self.accepted_hist), len(other.accepted_hist))
        for source in (self.accepted_hist, other.accepted_hist):
            for n, count in enumerate(source):
                hist[n] += count
        return RowStats(
            self.target_calls + other.target_calls,
            self.drafter_calls + other.drafter_calls,
            self.drafted + other.drafted,
            self.accepted + other.accepted,
            self.recovered + other.recovered,
            self.bonus + other.bonus,
            self.new_tokens + other.new_tokens,
            hist,
            self.drafting_calls + other.drafting_calls,
        )

    def as_dict(self) -> dict:
        return {
            "target_calls": self.target_calls,
            "drafter_calls": self.drafter_calls,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "recovered": self.recovered,
            "bonus": self.bonus,
            "new_tokens": self.new_tokens,
            "tokens_per_target_call": self.tokens_per_target_call,
            "acceptance_rate": self.acceptance_rate,
            "accepted_hist": list(self.accepted_hist),
            "drafting_calls": self.drafting_calls,
        }


@dataclass(frozen=True)
class CostFigures:
    """What a decode's passes cost: verify seconds (without the coupling pass), draft seconds,
    target and drafter passes. Differences of two readings give a stretch of the decode."""

    verify_seconds: float = 0.0
    draft_seconds: float = 0.0
    target_passes: int = 0
    drafter_passes: int = 0

    def __add__(self, other: CostFigures) -> CostFigures:
        return CostFigures(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))

    def __sub__(self, other: CostFigures) -> CostFigures:
        return CostFigures(*(a - b for a, b in zip(astuple(self), astuple(other), strict=True)))


@dataclass
class DecodeStats:
    """Per-row figures plus the batch's own cost: batched forwards and wall time."""

    rows: list[RowStats]
    target_passes: int = 0
    drafter_passes: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    policy_seconds: float = 0.0  # inside drafting: the length policy's decisions (e.g. the head)
    # coupled randomness only: the extra drafter pass for bonus tokens (not part of the method)
    coupling_seconds: float = 0.0
    coupling_passes: int = 0
    wall_seconds: float = 0.0
    # the first round of a batch holds both prefills (prompt through target and drafter), the
    # same work for every method; the time and tokens after it are the decoding proper
    first_round_seconds: float = 0.0
    first_round_tokens: int = 0
    # the first round's share of `cost_figures`, so per-call costs can be read without prefills
    first_round_costs: CostFigures = field(default_factory=CostFigures)

    @property
    def total(self) -> RowStats:
        total = RowStats()
        for row in self.rows:
            total = total.merge(row)
        return total

    def heard(self, seconds: float, policy_seconds: float, passes: int) -> None:
        """A round's draft, asked for in `seconds`: its length policy's share of them and the
        drafter's passes (`Draft.policy_seconds`, `Draft.passes`)."""
        self.draft_seconds += seconds
        self.policy_seconds += policy_seconds
        self.drafter_passes += passes

    def cost_figures(self) -> CostFigures:
        """The passes' costs so far, the coupling pass left out of the verify time."""
        verify = self.verify_seconds - self.coupling_seconds
        return CostFigures(verify, self.draft_seconds, self.target_passes, self.drafter_passes)

    def costs_after_first_round(self) -> CostFigures:
        return self.cost_figures() - self.first_round_costs

    def end_first_round(self, before: CostFigures, seconds: float, tokens: int) -> None:
        """File the first round (its prefills): `before` is `cost_figures` at its start."""
        self.first_round_seconds += seconds
        self.first_round_tokens += tokens
        self.first_round_costs = self.first_round_costs + (self.cost_figures() - before)

    def absorb(self, part: DecodeStats, rows: list[int]) -> None:
        """Add the figures of a sub-batch whose row i is row `rows[i]` of this one."""
        for i, row in enumerate(rows):
            self.rows[row] = self.rows[row].merge(part.rows[i])
        self.target_passes += part.target_passes
        self.drafter_passes += part.drafter_passes
        self.draft_seconds += part.draft_seconds
        self.verify_seconds += part.verify_seconds
        self.policy_seconds += part.policy_seconds
        self.coupling_seconds += part.coupling_seconds
        self.coupling_passes += part.coupling_passes
        self.wall_seconds += part.wall_seconds
        self.first_round_seconds += part.first_round_seconds
        self.first_round_tokens += part.first_round_tokens
        self.first_round_costs = self.first_round_costs + part.first_round_costs

    def as_dict(self) -> dict:
        return {
            "total": self.total.as_dict(),
            "rows": [row.as_dict() for row in self.rows],
            "target_passes": self.target_passes,
            "drafter_passes": self.drafter_passes,
            "draft_seconds": self.draft_seconds,
            "verify_seconds": self.verify_seconds,
            "policy_seconds": self.policy_seconds,
            "coupling_seconds": self.coupling_seconds,
            "coupling_passes": self.coupling_passes,
            "wall_seconds": self.wall_seconds,
            "first_round_seconds": self.first_round_seconds,
            "first_round_tokens": self.first_round_tokens,
            "first_round_costs": asdict(self.first_round_costs),
        }

    def summary(self) -> str:
        t = self.total
        hist = " ".join(f"{n}:{c}" for n, c in enumerate(t.accepted_hist))
        return (
            f"{t.new_tokens} tokens in {self.wall_seconds:.2f}s "
            f"({t.new_tokens / max(self.wall_seconds, 1e-9):.1f} tok/s); "
            f"target calls {t.target_calls} ({self.target_passes} batched), "
            f"drafter calls {t.drafter_calls} ({self.drafter_passes} batched); "
            f"drafted {t.drafted}, accepted {t.accepted}, recovered {t.recovered}, "
            f"bonus {t.bonus}; tokens/target call {t.tokens_per_target_call:.2f}, "
            f"acceptance {t.acceptance_rate:.3f}; drafting {self.draft_seconds:.2f}s, "
            f"verifying {self.verify_seconds:.2f}s, length policy {self.policy_seconds:.3f}s; "
            f"accepted-length histogram {hist}"
        )
