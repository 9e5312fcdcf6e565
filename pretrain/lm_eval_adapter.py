"""`DenseFormerLM`: a trained model as an lm-evaluation-harness 0.4.x model, `denseformer`.

    python -m pretrain lm-eval --model_args checkpoint=runs/tiny --tasks hellaswag

Text reaches the model as it did in training: the end-of-document id first (the data has one
before every document, and no BOS), then the tokenizer's ids. lm-eval asks three things:

- `loglikelihood` (context, continuation): the summed log-probability of the continuation's
  ids after the context's, and whether greedy decoding picks every one of them. Trailing
  spaces of the context move to the continuation and the two are encoded as one text, as
  lm-eval's own models do. Longer than the model's context, the ids are cut from the left.
- `loglikelihood_rolling` (text): the log-probability of the whole text after the EOS,
  scored over lm-eval's rolling windows (`get_rolling_token_windows`) of `seq_len` tokens,
  each id predicted once.
- `generate_until` (context, gen_kwargs): greedy (or sampled with `do_sample`) continuation
  of at most `max_gen_toks` ids, cut at the first `until` string. The context keeps its last
  `seq_len - max_gen_toks` ids, so prompt and answer fit the model's context.

Requests run `batch_size` at a time, longest first, right-padded (causal attention: padding
after a sequence does not change its logits). One process; on a GPU under bf16 autocast as
in training.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from pretrain.generation import generate
from pretrain.load import load_model

log = logging.getLogger(__name__)

MODEL_NAME = "denseformer"
DEFAULT_BATCH_SIZE = 16  # when lm-eval says "auto": we do not search for one
DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's own default for generation tasks


@register_model(MODEL_NAME)
class DenseFormerLM(LM):
    """lm-eval's view of a run directory, native checkpoint or exported directory."""

    def __init__(self, checkpoint: str, batch_size: int | str | None = None,
                 max_batch_size: int | None = None, device: str | None = None,
                 max_gen_toks: int = DEFAULT_MAX_GEN_TOKS, seed: int = 0, **unused) -> None:
        """Load `checkpoint` with `pretrain.load.load_model`. `device` is lm-eval's option;
        its default (cuda:0) on a machine without a GPU means this machine's default."""
        super().__init__()

        if unused:
            log.warning("denseformer: ignoring model_args %s", sorted(unused))
        self.checkpoint = str(checkpoint)
        self.model, self.tokenizer = load_model(self.checkpoint, _usable_device(device))
        self.eos_id = self.tokenizer.eos_id
        if self.eos_id is None:
            raise ValueError(f"{checkpoint}: its tokenizer has no end-of-document id, which "
                             "every request starts with (as every training document did)")
        self.seq_len = self.model.config.seq_len
        self.batch_size = _batch_size(batch_size, max_batch_size)
        self.max_gen_toks = int(max_gen_toks)
        self.seed = int(seed)
        self._device = next(self.model.parameters()).device

    # -- what lm-eval calls --------------------------------------------------------------

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        """(log p(continuation | context), greedy) for each request's (context, continuation)."""
        sequences = []
        for request in requests:
            context, continuation = request.args
            context_ids, continuation_ids = self.encode_pair(context, continuation)
            if len(continuation_ids) > self.seq_len:
                raise ValueError(f"a continuation of {len(continuation_ids)} tokens does not "
                                 f"fit the model's context of {self.seq_len}: "
                                 f"{continuation[:80]!r}")
            ids = (context_ids + continuation_ids)[-(self.seq_len + 1):]
            sequences.append((ids, len(continuation_ids)))
        results = self.score(sequences)
        for request, result in zip(requests, results, strict=True):
            self.cache_hook.add_partial("loglikelihood", request.args, result)
        return results

    def loglikelihood_rolling(self, requests) -> list[float]:
        """log p(text | EOS) of each request's text, over lm-eval's rolling windows."""
        windows, owners = [], []
        for number, request in enumerate(requests):
            (text,) = request.args[:1]
            for context, predicted in map(make_disjoint_window, get_rolling_token_windows(
                    self.tokenizer.encode(text), self.eos_id, self.seq_len, 1)):
                windows.append((context + predicted, len(predicted)))
                owners.append(number)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self.score(windows), strict=True):
            totals[owner] += logprob
        for request, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests) -> list[str]:
        """Each request's continuation, cut before the first of its `until` strings."""
        answers: list[str | None] = [None] * len(requests)
        by_options: dict[str, list[int]] = {}
        for number, request in enumerate(requests):
            by_options.setdefault(repr(sorted(request.args[1].items())), []).append(number)
        for numbers in by_options.values():
            options = dict(requests[numbers[0]].args[1])
            for first in range(0, len(numbers), self.batch_size):
                chunk = numbers[first:first + self.batch_size]
                texts = self.generate([requests[n].args[0] for n in chunk], options)
                for number, text in zip(chunk, texts, strict=True):
                    answers[number] = text
                    self.cache_hook.add_partial("generate_until", requests[number].args, text)
        return answers

    # -- the work --------------------------------------------------------------------------

    def context_ids(self, text: str) -> list[int]:
        """EOS, then the ids of `text` (an empty text is the EOS alone)."""
        return [self.eos_id] + (self.tokenizer.encode(text) if text else [])

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """(context ids with the leading EOS, continuation ids), split as lm-eval's models
        split them: the two texts encoded together, the context's trailing spaces moved
        into the continuation (a tokenizer merges a space with the word after it)."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole = self.context_ids(context + continuation)
        context_length = len(self.context_ids(context))
        return whole[:context_length], whole[context_length:]

    @torch.no_grad()
    def score(self, sequences: Sequence[tuple[list[int], int]]) -> list[tuple[float, bool]]:
        """For each (ids, n): the summed log-probability of the last n ids, each predicted
        from the ids before it, and whether each is the most likely id there. len(ids) is
        at most seq_len + 1 and n at most len(ids) - 1."""
        results: list[tuple[float, bool] | None] = [None] * len(sequences)
        order = sorted(range(len(sequences)), key=lambda n: -len(sequences[n][0]))
        for first in range(0, len(order), self.batch_size):
            chunk = order[first:first + self.batch_size]
            inputs = [sequences[n][0][:-1] for n in chunk]
            width = len(inputs[0])
            if width > self.seq_len:
                raise ValueError(f"{width} input ids exceed the model's context {self.seq_len}")
            tokens = torch.tensor([row + [0] * (width - len(row)) for row in inputs],
                                  device=self._device)
            with self._autocast():
                logits = self.model(tokens)
            logprobs = F.log_softmax(logits.float(), dim=-1)
            for row, n in enumerate(chunk):
                ids, count = sequences[n]
                if not 0 < count < len(ids):
                    raise ValueError(f"cannot score {count} of {len(ids)} ids")
                targets = torch.tensor(ids[-count:], device=self._device)
                scored = logprobs[row, len(ids) - 1 - count:len(ids) - 1]
                total = scored.gather(-1, targets[:, None]).sum().item()
                greedy = bool((scored.argmax(dim=-1) == targets).all())
                results[n] = (total, greedy)
        return results

    def generate(self, contexts: list[str], options: dict) -> list[str]:
        """Continuations of `contexts` under one request's gen_kwargs (one batch)."""
        until = options.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        max_new = max(1, min(int(options.get("max_gen_toks", self.max_gen_toks)),
                           self.seq_len - 1))
        temperature = float(options.get("temperature", 0.0) or 0.0)
        greedy = not options.get("do_sample", False) or temperature == 0.0
        prompts = [self.context_ids(text)[-(self.seq_len - max_new):] for text in contexts]
        with self._autocast():
            completions = generate(self.model, prompts, max_new, greedy=greedy,
                                   temperature=temperature or 1.0, seed=self.seed,
                                   eos_id=self.eos_id)
        return [_cut(self.new_text(prompt, completion.tokens), until)
                for prompt, completion in zip(prompts, completions, strict=True)]

    def new_text(self, prompt: list[int], new_ids: list[int]) -> str:
        """The text `new_ids` add after `prompt`, leading space included (decoding the new
        ids alone would drop it)."""
        before = self.tokenizer.decode(prompt)
        after = self.tokenizer.decode(prompt + new_ids)
        return after[len(before):] if after.startswith(before) else \
            self.tokenizer.decode(new_ids)

    def _autocast(self):
        if self._device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()


def _cut(text: str, until: list[str]) -> str:
    """`text` up to the first occurrence of any stop string."""
    for stop in until:
        if stop:
            text = text.split(stop, 1)[0]
    return text


def _batch_size(batch_size: int | str | None, max_batch_size: int | None) -> int:
    """lm-eval's --batch_size as a number: "auto" (no search here) is DEFAULT_BATCH_SIZE,
    capped by --max_batch_size."""
    text = str(batch_size) if batch_size is not None else "1"
    if text.startswith("auto"):
        size = DEFAULT_BATCH_SIZE if max_batch_size is None else min(DEFAULT_BATCH_SIZE,
                                                                       int(max_batch_size))
    else:
        size = int(text)
    if size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size!r}")
    return size


def _usable_device(device: str | None) -> str | None:
    """`device` when this machine has it; None (load_model's choice) otherwise."""
    if device is None or (str(device).startswith("cuda") and not torch.cuda.is_available()):
        return None
    return str(device)

