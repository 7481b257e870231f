import datasets
import pytest

from hf_actcomp import add_sample_ids
from hf_actcomp.data import build_tokenizer, causal_lm_datasets, offline_corpus


def test_add_sample_ids():
    ds = datasets.Dataset.from_dict({"text": ["a", "b", "c"]})
    with_ids = add_sample_ids(ds)
    assert with_ids["sample_id"] == [0, 1, 2]
    assert with_ids.features["sample_id"].dtype == "int64"
    with pytest.raises(ValueError, match="already has a 'sample_id' column"):
        add_sample_ids(with_ids)
    with pytest.raises(TypeError, match="expects a datasets.Dataset"):
        add_sample_ids([1, 2])


def test_offline_corpus_tokenizer_and_blocks():
    texts = offline_corpus()
    assert len(texts) > 50 and sum(map(len, texts)) > 300_000
    tokenizer = build_tokenizer(texts[:20], vocab_size=300)
    assert len(tokenizer) <= 300
    assert tokenizer.decode(tokenizer("The if statement")["input_ids"]) == "The if statement"
    train, evaluation = causal_lm_datasets(tokenizer, texts[:20], seq_len=32, eval_fraction=0.2)
    assert set(train.column_names) == {"input_ids", "attention_mask", "labels", "sample_id"}
    assert "sample_id" not in evaluation.column_names
    assert all(len(row) == 32 for row in train["input_ids"])
    assert train["sample_id"] == list(range(len(train)))
    assert abs(len(evaluation) / (len(train) + len(evaluation)) - 0.2) < 0.05
