"""How close a compiled model's predictions are to a reference model's: teacher-forced top-1 agreement, free-running
greedy agreement, perplexity. For judging lossy passes (quantization) on real weights.

Every measure runs whole sequences through the compiled graph as one sequence (`CompiledModel.example_inputs`,
logits at every row), so it needs no engine; the free-running comparison takes token lists the caller generated.
This module measures; it changes no model and asserts nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mini_infer.compiler import CompiledModel


def sequence_logits(cm: CompiledModel, ids: Sequence[int]) -> torch.Tensor:
    """Logits [T, V] (fp32) at every position of `ids`, run as one sequence from position 0."""
    device = cm.context.device
    t = torch.tensor([list(ids)], device=device)
    inputs = cm.example_inputs(t)
    if "logits_indices" in inputs:
        inputs["logits_indices"] = torch.arange(t.shape[1], device=device)
    return cm(**inputs)[0].float()


@dataclass
class Agreement:
    """Positions where two models' argmax agree, out of how many."""

    agree: int
    total: int

    @property
    def rate(self) -> float:
        return self.agree / self.total if self.total else float("nan")


def teacher_forced_agreement(model: CompiledModel, reference: CompiledModel,
                             sequences: Sequence[tuple[Sequence[int], int]]) -> Agreement:
    """Top-1 agreement of `model` with `reference` on each (ids, prompt_len): at every position from the last
    prompt token on, both predict the next token from the same context (the reference's own continuation)."""
    agree = total = 0
    for ids, prompt_len in sequences:
        if not 1 <= prompt_len < len(ids):
            raise ValueError(f"prompt_len {prompt_len} must be in [1, {len(ids)}) (ids of length {len(ids)})")
        a = sequence_logits(model, ids)[prompt_len - 1:-1].argmax(-1)
        b = sequence_logits(reference, ids)[prompt_len - 1:-1].argmax(-1)
        agree += int((a == b).sum())
        total += a.numel()
    return Agreement(agree, total)


def greedy_agreement(outputs: Sequence[Sequence[int]], references: Sequence[Sequence[int]]) -> tuple[Agreement, float]:
    """Free-running comparison of generated token lists: tokens equal at the same position, and the mean length
    of the common prefix as a fraction of the reference length (1.0: identical)."""
    agree = total = 0
    prefix = 0.0
    for out, ref in zip(outputs, references, strict=True):
        agree += sum(int(a == b) for a, b in zip(out, ref))
        total += len(ref)
        same = next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), min(len(out), len(ref)))
        prefix += same / len(ref) if ref else 1.0
    return Agreement(agree, total), prefix / max(1, len(references))


def perplexity(cm: CompiledModel, ids: Sequence[int]) -> float:
    """exp(mean negative log-likelihood) of ids[1:] given the prefix, one sequence."""
    if len(ids) < 2:
        raise ValueError("perplexity needs at least two tokens")
    logits = sequence_logits(cm, ids)[:-1]
    target = torch.tensor(list(ids[1:]), device=logits.device)
    return float(torch.exp(torch.nn.functional.cross_entropy(logits, target)))


__all__ = ["Agreement", "greedy_agreement", "perplexity", "sequence_logits", "teacher_forced_agreement"]
