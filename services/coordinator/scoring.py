"""Scoring prompts for ``/v1/completions`` with ``echo`` or ``logprobs`` (what
lm-evaluation-harness asks for its log-likelihood tasks), as plain data: the prompts padded
into one batch for one pass through the swarm (:meth:`shared.inference.SwarmSession.score`),
and OpenAI's legacy ``logprobs`` object of each choice from the scores.

The legacy object lists one entry per token of the choice's text (the prompt's tokens with
``echo``, then the completion's)::

    {"tokens": [str], "token_logprobs": [float | None], "top_logprobs": [{str: float} | None],
     "text_offset": [int]}

The first prompt token has no log-probability (``None``, as OpenAI's): nothing comes before
it. ``top_logprobs[i]`` holds the N most likely tokens at token i's position (N = the
request's ``logprobs``; two alternatives of the same text keep the likelier). A token's
text is its own decoding, or where that is not whole characters (a byte of a longer UTF-8
character) a name of its own (``token_text``: OpenAI's ``bytes:\\xe2`` for bytes);
``text_offset`` counts the decoded tokens' characters from the start of the choice's text,
as vLLM does: exact wherever tokens end on character boundaries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from shared.inference import Scores


@dataclass(frozen=True)
class ScoringBatch:
    """Prompts of token ids right-padded into one batch: causal attention keeps a prompt's
    positions blind to the padding after it."""

    ids: torch.Tensor  # (B, T) the prompts, padded with pad_id
    targets: torch.Tensor  # (B, T) each position's next token of its prompt; -1 past the prompt's end
    lengths: tuple[int, ...]

    @classmethod
    def of(cls, prompts: list[list[int]], pad_id: int) -> ScoringBatch:
        assert prompts and all(prompts), "every prompt to score needs at least one token"
        B, T = len(prompts), max(len(p) for p in prompts)
        ids = torch.full((B, T), pad_id, dtype=torch.long)
        targets = torch.full((B, T), -1, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, : len(prompt)] = torch.tensor(prompt, dtype=torch.long)
            targets[row, : len(prompt) - 1] = ids[row, 1 : len(prompt)]
        return cls(ids, targets, tuple(len(p) for p in prompts))

    @property
    def logits_at(self) -> list[int]:
        """Each prompt's last position: its logits give the next token."""
        return [n - 1 for n in self.lengths]


def choice_logprobs(
    scores: Scores,
    row: int,
    prompt: list[int],
    completion: list[int],
    *,
    echo: bool,
    token_text: Callable[[int], str],
    decode: Callable[[list[int]], str],
) -> dict:
    """The legacy ``logprobs`` object of row ``row``: ``prompt``'s tokens if ``echo``, then
    ``completion`` (at most one token, drawn from the logits at the prompt's last position)."""
    top_ids, top_values = scores.top_ids[row].tolist(), scores.top_logprobs[row].tolist()  # (T, N) each
    target_logprobs = scores.target_logprobs[row].tolist()

    def alternatives(position: int) -> dict[str, float]:
        top: dict[str, float] = {}
        for token, value in zip(top_ids[position], top_values[position]):
            top.setdefault(token_text(token), value)  # most likely first: a duplicate text keeps the likelier
        return top

    entries: list[tuple[int, float | None, dict | None]] = []
    if echo:
        entries.append((prompt[0], None, None))
        entries += [(prompt[t], target_logprobs[t - 1], alternatives(t - 1)) for t in range(1, len(prompt))]
    last = len(prompt) - 1
    for token in completion:
        if token in top_ids[last]:  # the same number as its alternative's (a greedy token: the first)
            value = top_values[last][top_ids[last].index(token)]
        else:
            value = float(torch.log_softmax(scores.logits[row].float(), dim=-1)[token])
        entries.append((token, value, alternatives(last)))
    offsets = [0]
    for token, _, _ in entries[:-1]:
        offsets.append(offsets[-1] + len(decode([token])))
    return {
        "tokens": [token_text(token) for token, _, _ in entries],
        "token_logprobs": [value for _, value, _ in entries],
        "top_logprobs": [top for _, _, top in entries],
        "text_offset": offsets[: len(entries)],
    }
