"""(prompt, answer) pairs as chat-format training batches and generation prompts for SmolLM2-Instruct.

The tokenizer's facts this relies on: pad = eos = `<|im_end|>` (id 2), padding on the right by default,
and a chat template that inserts a default system prompt when the messages have none. So:

- every conversation, in training and evaluation, starts with the same explicit `SYSTEM_PROMPT`;
- an example is the generation prompt's tokens (system, user, "<|im_start|>assistant\\n") followed by
  the answer's tokens and the closing `<|im_end|>`, each part tokenized on its own, so the tokens the model
  learns to continue are those `generation_inputs` gives it;
- the labels are the input ids on the answer's tokens and on the closing `<|im_end|>` (so the expert
  learns to stop), IGNORE_INDEX elsewhere; a batch pads on the right and drops the labels where the
  attention mask is 0, never by comparing with the pad id (pad == eos: that would drop the stop token);
- batched generation pads on the left, so every row's last token is its "assistant\\n".
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedTokenizerBase

from mergecompose.core.training import IGNORE_INDEX

SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"  # the template's default
END_OF_TURN = "<|im_end|>"


def chat_messages(prompt: str, answer: str | None = None) -> list[dict[str, str]]:
    """The system prompt, the user's `prompt` and, if given, the assistant's `answer`."""
    for name, value in (("prompt", prompt), ("answer", answer)):
        if value is not None and (not isinstance(value, str) or not value.strip()):
            raise ValueError(f"`{name}` must be a non-empty str, got {value!r:.80}")
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": prompt}]
    if answer is not None:
        messages.append({"role": "assistant", "content": answer})
    return messages


def generation_text(tokenizer: PreTrainedTokenizerBase, prompt: str) -> str:
    """The chat template's text for `prompt`, ending with the assistant's turn opened."""
    text = tokenizer.apply_chat_template(chat_messages(prompt), tokenize=False, add_generation_prompt=True)
    return str(text)


def end_of_turn_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The id of `<|im_end|>`; an error if the tokenizer has it not as one token."""
    ids = tokenizer.encode(END_OF_TURN, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"`tokenizer` must have {END_OF_TURN!r} as one token (a ChatML tokenizer), got ids {ids}")
    return int(ids[0])


def tokenize_example(tokenizer: PreTrainedTokenizerBase, prompt: str, answer: str) -> tuple[list[int], list[int]]:
    """`(input_ids, labels)` of one conversation: labels on the answer's tokens and the closing `<|im_end|>`."""
    chat_messages(prompt, answer)  # checks both
    prefix = tokenizer.encode(generation_text(tokenizer, prompt), add_special_tokens=False)
    completion = [*tokenizer.encode(answer, add_special_tokens=False), end_of_turn_id(tokenizer)]
    return prefix + completion, [IGNORE_INDEX] * len(prefix) + completion


def training_batch(
    tokenizer: PreTrainedTokenizerBase, pairs: Sequence[tuple[str, str]], max_length: int | None = None
) -> dict[str, torch.Tensor]:
    """Right-padded `input_ids`, `attention_mask` and `labels`, `(batch, seq)` each, for a causal LM.

    The format of `mergecompose.core.training.train_lora_expert` (and of transformers): `labels[:, t]`
    is the token at t, the logit at t - 1 predicts it. An example longer than `max_length` is an error,
    never cut (a cut answer would lose its `<|im_end|>`).
    """
    if not pairs:
        raise ValueError("`pairs` must hold at least one (prompt, answer) pair, got none")
    if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 2):
        raise ValueError(f"`max_length` must be None or an integer >= 2, got {max_length!r}")
    examples = []
    for index, pair in enumerate(pairs):
        if not (isinstance(pair, tuple) and len(pair) == 2):
            raise ValueError(f"`pairs[{index}]` must be a (prompt, answer) tuple, got {pair!r:.80}")
        ids, example_labels = tokenize_example(tokenizer, *pair)
        if max_length is not None and len(ids) > max_length:
            raise ValueError(f"`pairs[{index}]` is {len(ids)} tokens, more than `max_length` {max_length}")
        examples.append((ids, example_labels))
    pad_id = _pad_id(tokenizer)
    input_ids, attention_mask = _padded([ids for ids, _ in examples], pad_id, left=False)  # (B, T) each
    labels, _ = _padded([example_labels for _, example_labels in examples], IGNORE_INDEX, left=False)  # (B, T)
    labels = labels.masked_fill(attention_mask == 0, IGNORE_INDEX)  # padding never carries a target
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def generation_inputs(tokenizer: PreTrainedTokenizerBase, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
    """Left-padded `input_ids` and `attention_mask`, `(batch, seq)`, of the prompts' generation texts."""
    if not prompts:
        raise ValueError("`prompts` must hold at least one prompt, got none")
    rows = [tokenizer.encode(generation_text(tokenizer, prompt), add_special_tokens=False) for prompt in prompts]
    input_ids, attention_mask = _padded(rows, _pad_id(tokenizer), left=True)  # (B, T) each
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def _pad_id(tokenizer: PreTrainedTokenizerBase) -> int:
    return int(tokenizer.pad_token_id) if tokenizer.pad_token_id is not None else end_of_turn_id(tokenizer)


def _padded(rows: Sequence[list[int]], value: int, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows padded with `value` to the longest, on the left or the right, and their attention mask."""
    width = max(len(row) for row in rows)
    values = torch.full((len(rows), width), value, dtype=torch.long)  # (B, T)
    mask = torch.zeros((len(rows), width), dtype=torch.long)  # (B, T)
    for index, row in enumerate(rows):
        where = slice(width - len(row), width) if left else slice(0, len(row))
        values[index, where] = torch.tensor(row, dtype=torch.long)
        mask[index, where] = 1
    return values, mask
