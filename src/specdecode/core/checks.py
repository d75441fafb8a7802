"""Set-up checks that turn silent wrong answers into clear errors, before any decoding."""

from __future__ import annotations

import torch


class IncompatibleModelsError(ValueError):
    """Target and drafter cannot be paired."""


def check_same_device(target: torch.nn.Module, drafter: torch.nn.Module) -> None:
    # read here, not through `backends.torch_eager`: importing it imports `transformers`, which
    # the llama.cpp backend's decoding never needs
    t, d = next(target.parameters()).device, next(drafter.parameters()).device
    if t != d:
        raise IncompatibleModelsError(
            f"target is on {t} but drafter is on {d}; put both on the same device "
            "(e.g. model.to('cuda:0'))"
        )


def check_same_vocabulary(target_tokenizer, drafter_tokenizer) -> None:
    """Compare the token lists themselves: families often pad the embedding to a round size,
    so equal embedding sizes prove nothing, and unequal ones need not be a problem."""
    t_vocab, d_vocab = target_tokenizer.get_vocab(), drafter_tokenizer.get_vocab()
    if t_vocab != d_vocab:
        only_t = sorted(set(t_vocab.items()) - set(d_vocab.items()), key=lambda x: x[1])[:3]
        only_d = sorted(set(d_vocab.items()) - set(t_vocab.items()), key=lambda x: x[1])[:3]
        raise IncompatibleModelsError(
            f"target and drafter tokenizers differ ({len(t_vocab)} vs {len(d_vocab)} tokens; "
            f"e.g. (token, id) only in the target: {only_t}, only in the drafter: {only_d}); "
            "speculative decoding needs a drafter with the target's vocabulary"
        )
    for name in ("eos_token_id", "bos_token_id"):
        t_id, d_id = getattr(target_tokenizer, name, None), getattr(drafter_tokenizer, name, None)
        if t_id != d_id:
            raise IncompatibleModelsError(
                f"target and drafter tokenizers share a vocabulary but disagree on {name} "
                f"({t_id} vs {d_id})"
            )


def check_vocab_covers_tokenizer(size: int, tokenizer, role: str) -> None:
    if tokenizer is not None and len(tokenizer) > size:
        raise IncompatibleModelsError(
            f"{role} has {size} output logits but its tokenizer has {len(tokenizer)} tokens"
        )


def check_prompts(prompts: list[list[int]], max_new_tokens: int, context: int | None) -> None:
    if not prompts:
        raise ValueError("no prompts given")
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        if context is None:
            continue
        if len(prompt) > context:
            raise ValueError(
                f"prompt {i} has {len(prompt)} tokens, longer than the target's context of "
                f"{context} tokens"
            )
        if len(prompt) + max_new_tokens > context:
            raise ValueError(
                f"prompt {i} has {len(prompt)} tokens and max_new_tokens is {max_new_tokens}: "
                f"{len(prompt) + max_new_tokens} exceeds the target's context of {context}; "
                "lower max_new_tokens or shorten the prompt"
            )
