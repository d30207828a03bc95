"""Presence, frequency and repetition penalties, applied sparsely on the sampling device.

Formulas (``SamplingParams``' docstring): repetition (transformers' definition, over
prompt + output) first, then frequency and presence (OpenAI's, over the output), the order
vLLM uses. Each request keeps its token ids on the device in a :class:`PenaltyTokens`
that grows by the tokens appended since the last step, so a step costs host work in the
number of penalised rows (and their new tokens), never in their length or the vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdserve.engine.sampling_params import SamplingParams


class PenaltyTokens:
    """One request's prompt + output token ids as a device tensor, kept in step with the
    request's live list.

    token_ids: the request's list of prompt + output ids (appended to in place, read
        here); num_prompt: how many of them are the prompt. A decode worker builds it from
        prompt + the first token prefill sampled, which is exactly a mixed worker's state.
    """

    def __init__(self, token_ids: list[int], num_prompt: int) -> None:
        self._ids = token_ids
        self.num_prompt = num_prompt
        # ids [0, _n) on the device, in a buffer of spare capacity (doubling): a step
        # writes only its new tokens, no concatenation of the whole history
        self._buf: torch.Tensor | None = None
        self._n = 0

    def tensor(self, device: torch.device) -> torch.Tensor:
        """``[L]`` int64 ids on ``device`` (prompt, then output), copying only new tokens.
        A view of a buffer: positions past ``L`` may be written later, never those."""
        ids, n, done = self._ids, len(self._ids), self._n
        buf = self._buf
        if buf is None or buf.device != device or done > n:
            buf = torch.empty(max(16, 2 * n), dtype=torch.int64, device=device)
            buf[:n] = torch.tensor(ids, dtype=torch.int64)
        elif done < n:
            if n > buf.numel():
                grown = torch.empty(2 * n, dtype=torch.int64, device=device)
                grown[:done] = buf[:done]
                buf = grown
            if n - done == 1:
                buf[done] = ids[done]  # one token a decode step: a fill, no host tensor
            else:
                buf[done:n] = torch.tensor(ids[done:n], dtype=torch.int64)
        self._buf, self._n = buf, n
        return buf[:n]

    def extended(self, extra: Sequence[int]) -> PenaltyTokens:
        """A new state holding these tokens followed by ``extra`` (output tokens): the
        penalties of a verify row's position after its drafts (``engine/spec/verify.py``)."""
        return PenaltyTokens(list(self._ids) + list(extra), self.num_prompt)

    def output(self, device: torch.device) -> torch.Tensor:
        """``[L - num_prompt]`` int64 ids of the output tokens (a view)."""
        return self.tensor(device)[self.num_prompt :]


def _coords(
    rows: Sequence[int], ids: Sequence[torch.Tensor], dev: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(row index, token id, tokens per row)`` for the ids of each row: the ``(row,
    token)`` coordinates of every token (duplicates kept), as int64 tensors."""
    lengths = torch.tensor([t.numel() for t in ids], device=dev)
    row_t = torch.tensor(list(rows), dtype=torch.int64, device=dev).repeat_interleave(lengths)
    return row_t, torch.cat(list(ids)), lengths


def apply_penalties(
    work: torch.Tensor,
    rows: Sequence[int],
    params: Sequence[SamplingParams],
    tokens: Sequence[PenaltyTokens],
) -> torch.Tensor:
    """Apply the penalties of ``params[j]`` over ``tokens[j]`` to row ``rows[j]`` of
    ``work[B, V]`` (fp32, in place; returned).

    Sparse: gathers and scatters at the ``(row, token)`` coordinates of the rows' tokens.
    A token that occurs several times is written several times with the same value
    (computed from one gather), so repetition and presence apply once per distinct
    token; frequency accumulates per occurrence.
    """
    if not rows:
        return work
    dev, dt = work.device, work.dtype
    rep = [j for j, p in enumerate(params) if p.repetition_penalty != 1.0]
    if rep:
        r_t, t_t, lengths = _coords(
            [rows[j] for j in rep], [tokens[j].tensor(dev) for j in rep], dev
        )
        factor = torch.tensor(
            [params[j].repetition_penalty for j in rep], device=dev, dtype=dt
        ).repeat_interleave(lengths)
        vals = work[r_t, t_t]
        work[r_t, t_t] = torch.where(vals > 0, vals / factor, vals * factor)
    freq = [p.frequency_penalty for p in params]
    pres = [p.presence_penalty for p in params]
    if not any(freq) and not any(pres):
        return work
    r_t, t_t, lengths = _coords(rows, [t.output(dev) for t in tokens], dev)
    if not t_t.numel():
        return work

    def spread(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, device=dev, dtype=dt).repeat_interleave(lengths)

    if any(freq):
        work.index_put_((r_t, t_t), -spread(freq), accumulate=True)
    if any(pres):
        work[r_t, t_t] = work[r_t, t_t] - spread(pres)
    return work
