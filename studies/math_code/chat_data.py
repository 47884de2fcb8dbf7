"""(prompt, answer) pairs as chat-format training batches and generation prompts, in two chat formats.

* **ChatML**, through the tokenizer's own chat template (SmolLM2-Instruct): the tokenizer's facts this relies on
  are pad = eos = `<|im_end|>` (id 2), padding on the right by default, and a chat template that inserts a
  default system prompt when the messages have none.
* **Gemma's turns**, written here, for a Gemma base whose tokenizer has no chat template (Gemma-3-270M):
  `<bos><start_of_turn>user\n{prompt}<end_of_turn>\n<start_of_turn>model\n`, the answer, `<end_of_turn>`
  (both markers one token each). There is no system turn: Gemma's own template has none.

The format is the first whose end-of-turn marker the tokenizer has as one token (`chat_format`). So:

- every ChatML conversation, in training and evaluation, starts with the same explicit `SYSTEM_PROMPT`;
- an example is the generation prompt's tokens (ChatML: system, user, "<|im_start|>assistant\\n") followed by
  the answer's tokens and the closing end-of-turn token, each part tokenized on its own, so the tokens the
  model learns to continue are those `generation_inputs` gives it;
- the labels are the input ids on the answer's tokens and on the closing end-of-turn token (so the expert
  learns to stop), IGNORE_INDEX elsewhere; a batch pads on the right and drops the labels where the
  attention mask is 0, never by comparing with the pad id (pad == eos: that would drop the stop token);
- batched generation pads on the left, so every row's last token is its "assistant\\n" (or "model\\n").
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedTokenizerBase

from mergecompose.core.training import IGNORE_INDEX

SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"  # the template's default
END_OF_TURN = "<|im_end|>"  # ChatML's
GEMMA_START_OF_TURN, GEMMA_END_OF_TURN = "<start_of_turn>", "<end_of_turn>"
CHAT_FORMATS = {"chatml": END_OF_TURN, "gemma": GEMMA_END_OF_TURN}  # each format's end-of-turn marker


def chat_messages(prompt: str, answer: str | None = None) -> list[dict[str, str]]:
    """The system prompt, the user's `prompt` and, if given, the assistant's `answer`."""
    for name, value in (("prompt", prompt), ("answer", answer)):
        if value is not None and (not isinstance(value, str) or not value.strip()):
            raise ValueError(f"`{name}` must be a non-empty str, got {value!r:.80}")
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": prompt}]
    if answer is not None:
        messages.append({"role": "assistant", "content": answer})
    return messages


def _one_token(tokenizer: PreTrainedTokenizerBase, text: str) -> int | None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return int(ids[0]) if len(ids) == 1 else None


def chat_format(tokenizer: PreTrainedTokenizerBase) -> str:
    """ "chatml" or "gemma": the first format whose markers the tokenizer has as one token each (ChatML also needs
    the tokenizer's chat template); an error naming both otherwise."""
    if _one_token(tokenizer, END_OF_TURN) is not None and tokenizer.chat_template:
        return "chatml"
    if _one_token(tokenizer, GEMMA_END_OF_TURN) is not None and _one_token(tokenizer, GEMMA_START_OF_TURN) is not None:
        return "gemma"
    raise ValueError(
        f"`tokenizer` must be a ChatML tokenizer with its chat template ({END_OF_TURN!r} one token) or a Gemma "
        f"tokenizer ({GEMMA_START_OF_TURN!r} and {GEMMA_END_OF_TURN!r} one token each), got neither"
    )


def generation_text(tokenizer: PreTrainedTokenizerBase, prompt: str) -> str:
    """The chat text for `prompt`, ending with the assistant's (Gemma: the model's) turn opened."""
    messages = chat_messages(prompt)  # checks the prompt
    if chat_format(tokenizer) == "gemma":
        start, end = GEMMA_START_OF_TURN, GEMMA_END_OF_TURN
        return f"{tokenizer.bos_token or ''}{start}user\n{prompt}{end}\n{start}model\n"
    return str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


def end_of_turn_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The id of the tokenizer's chat format's end-of-turn token (`<|im_end|>`, or Gemma's `<end_of_turn>`)."""
    token = CHAT_FORMATS[chat_format(tokenizer)]
    token_id = _one_token(tokenizer, token)
    assert token_id is not None  # chat_format checked it
    return token_id


def tokenize_example(tokenizer: PreTrainedTokenizerBase, prompt: str, answer: str) -> tuple[list[int], list[int]]:
    """`(input_ids, labels)` of one conversation: labels on the answer's tokens and the closing end-of-turn token."""
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
    never cut (a cut answer would lose its end-of-turn token).
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
