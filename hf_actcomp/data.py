"""Data helpers: sample ids for AQ-SGD, and an offline corpus with a locally built tokenizer.

The offline default lets the recipe, tests and benchmarks train on real English text with no
network: the Python reference documentation that every CPython installation carries
(`pydoc_data.topics`), tokenized by a byte-level BPE trained on it in a second.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import datasets
    from transformers import PreTrainedTokenizerFast

SAMPLE_ID = "sample_id"


def add_sample_ids(dataset: datasets.Dataset, column: str = SAMPLE_ID) -> datasets.Dataset:
    """Return `dataset` with an int64 column holding each row's index (AQ-SGD's memory key).

    Add ids before shuffling or sharding so that every row keeps its own id.
    """
    import datasets

    if not isinstance(dataset, datasets.Dataset):
        raise TypeError(f"add_sample_ids expects a datasets.Dataset, got {type(dataset).__name__}.")
    if column in dataset.column_names:
        raise ValueError(f"The dataset already has a {column!r} column.")
    return dataset.add_column(column, list(range(len(dataset))), feature=datasets.Value("int64"))


def offline_corpus() -> list[str]:
    """The Python reference documentation shipped with CPython: ~80 topics, ~465k characters."""
    from pydoc_data.topics import topics

    return [topics[name] for name in sorted(topics)]


def build_tokenizer(texts: list[str], vocab_size: int = 1024) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on `texts` (seconds, no download)."""
    from tokenizers import ByteLevelBPETokenizer, Tokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=2, special_tokens=["<|endoftext|>"],
                            show_progress=False)
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(bpe.to_str()), eos_token="<|endoftext|>", pad_token="<|endoftext|>",
        bos_token="<|endoftext|>", unk_token="<|endoftext|>",
    )


def causal_lm_datasets(
    tokenizer: PreTrainedTokenizerFast,
    texts: list[str],
    seq_len: int = 128,
    eval_fraction: float = 0.1,
    max_train_samples: int | None = None,
    eval_blocks: int | None = None,
) -> tuple[datasets.Dataset, datasets.Dataset]:
    """Concatenate `texts`, cut them into fixed-length blocks, and split train / eval.

    Rows carry `input_ids`, `attention_mask`, `labels` (= input_ids) and, in train, `sample_id`.
    Fixed length keeps pipeline shapes static and lets AQ-SGD keep one activation per row.
    The eval split is the last `eval_blocks` blocks when given, else the last `eval_fraction` of them.
    """
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction={eval_fraction!r} must lie in (0, 1).")
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer(text)["input_ids"])
        ids.append(tokenizer.eos_token_id)
    blocks = [ids[i : i + seq_len] for i in range(0, len(ids) - seq_len + 1, seq_len)]
    if len(blocks) < 2:
        raise ValueError(f"The corpus gives {len(blocks)} blocks of {seq_len} tokens; need at least 2.")
    num_eval = max(1, int(len(blocks) * eval_fraction)) if eval_blocks is None else eval_blocks
    if not 1 <= num_eval < len(blocks):
        raise ValueError(f"eval_blocks={eval_blocks!r}: the corpus gives {len(blocks)} blocks of {seq_len} tokens, "
                         "and the eval split needs at least 1 and must leave 1 to train on.")
    train_blocks, eval_blocks = blocks[:-num_eval], blocks[-num_eval:]
    if max_train_samples is not None:
        train_blocks = train_blocks[:max_train_samples]

    import datasets

    def to_dataset(rows: list[list[int]]) -> datasets.Dataset:
        return datasets.Dataset.from_dict(
            {"input_ids": rows, "attention_mask": [[1] * seq_len for _ in rows], "labels": rows}
        )

    return add_sample_ids(to_dataset(train_blocks)), to_dataset(eval_blocks)
