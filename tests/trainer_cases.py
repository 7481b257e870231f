"""Shared by the ActCompTrainer tests and their worker: a tiny data set with rows of different
lengths, a padding collator, and the TrainingArguments every exactness run uses."""

from __future__ import annotations

import datasets
import torch
from transformers import TrainingArguments


def ragged_dataset(rows: int = 32, length: int = 12, seed: int = 0) -> datasets.Dataset:
    """Token rows of 6..length tokens (vocabulary 256), so that batches need padding."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (rows, length), generator=g)
    lengths = torch.randint(6, length + 1, (rows,), generator=g)
    tokens = [ids[i, : lengths[i]].tolist() for i in range(rows)]
    return datasets.Dataset.from_dict(
        {"input_ids": tokens, "labels": tokens, "attention_mask": [[1] * len(t) for t in tokens]}
    )


def pad_collator(features: list[dict]) -> dict[str, torch.Tensor]:
    """Right-pad to the batch's longest row, as Trainer's dynamic-padding collators do."""
    longest = max(len(f["input_ids"]) for f in features)
    batch = {}
    for key, pad in (("input_ids", 0), ("attention_mask", 0), ("labels", -100)):
        batch[key] = torch.tensor([f[key] + [pad] * (longest - len(f[key])) for f in features])
    if "sample_id" in features[0]:
        batch["sample_id"] = torch.tensor([f["sample_id"] for f in features])
    return batch


def training_args(output_dir: str, batch_size: int = 4, **overrides) -> TrainingArguments:
    """AdamW with a warmed-up linear schedule, accumulation 2, clipping at 1.0."""
    kwargs = dict(output_dir=output_dir, per_device_train_batch_size=batch_size, per_device_eval_batch_size=4,
                  gradient_accumulation_steps=2, max_grad_norm=1.0, learning_rate=1e-2, warmup_steps=2,
                  lr_scheduler_type="linear", max_steps=4, logging_steps=1, report_to=[], seed=0, use_cpu=True,
                  save_strategy="no", disable_tqdm=True)
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)


def lora_model(model):
    """LoRA (r=4) on every attention projection of a debug GPT-2, with a fixed initialisation."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj"],
                                                  lora_dropout=0.0, init_lora_weights="gaussian"))
    return peft_model


SAMPLE_PROMPTS = ["def add(a, b):", "The pipeline"]


def sample_tokenizer():
    """A byte-level BPE tokenizer of 300 tokens, trained (deterministically) on a few lines."""
    from hf_actcomp.data import build_tokenizer

    texts = ["def add(a, b): return a + b", "The pipeline splits the model into stages.", "import torch"] * 10
    return build_tokenizer(texts, vocab_size=300)


def argmax_logits(logits, labels):
    """preprocess_logits_for_metrics: the predicted token ids (what crosses instead of logits)."""
    return logits.argmax(dim=-1)


def token_metrics(prediction) -> dict[str, float]:
    """compute_metrics reading everything an EvalPrediction carries with include_for_metrics:
    next-token accuracy, the mean predicted id, the inputs' sum and the mean per-batch loss."""
    preds, labels = prediction.predictions, prediction.label_ids
    keep = labels[:, 1:] != -100
    return {"accuracy": float((preds[:, :-1][keep] == labels[:, 1:][keep]).mean()),
            "mean_prediction": float(preds[preds != -100].mean()),
            "inputs_sum": int(prediction.inputs[prediction.inputs != -100].sum()),
            "losses_mean": float(prediction.losses.mean())}


def extending_trainer():
    """A user's ActCompTrainer subclass that extends Trainer's methods through super(): the
    logged training loss and the evaluation loss doubled, one metric added, every log kept."""
    from hf_actcomp import ActCompTrainer

    class ExtendingTrainer(ActCompTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.seen_logs: list[dict] = []

        def training_step(self, model, inputs, num_items_in_batch=None):
            return 2 * super().training_step(model, inputs, num_items_in_batch)

        def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
            loss, logits, labels = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
            return 2 * loss, logits, labels

        def evaluation_loop(self, *args, **kwargs):
            output = super().evaluation_loop(*args, **kwargs)
            output.metrics[f"{kwargs.get('metric_key_prefix', 'eval')}_extended"] = 1.0
            return output

        def log(self, logs, start_time=None):
            self.seen_logs.append(dict(logs))
            super().log(logs, start_time)

    return ExtendingTrainer


def doubled(loss_function):
    """A model's loss function, doubled: a loss of the user's own, set with `model.loss_function =`."""
    return lambda *args, **kwargs: 2 * loss_function(*args, **kwargs)


def classification_rows(rows: int = 32, length: int = 12, num_labels: int = 3):
    """Token rows of 6..length tokens (ids 1..255: 0 is the pad token) with a class per row."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 256, (rows, length), generator=g)
    lengths = torch.randint(6, length + 1, (rows,), generator=g)
    tokens = [ids[i, : lengths[i]].tolist() for i in range(rows)]
    return datasets.Dataset.from_dict({"input_ids": tokens, "attention_mask": [[1] * len(t) for t in tokens],
                                       "labels": (torch.arange(rows) % num_labels).tolist()})


def class_collator(features: list[dict]) -> dict[str, torch.Tensor]:
    """Right-pad ids (pad token 0) and masks to the batch's longest row; one label per row."""
    longest = max(len(f["input_ids"]) for f in features)
    return {"input_ids": torch.tensor([f["input_ids"] + [0] * (longest - len(f["input_ids"])) for f in features]),
            "attention_mask": torch.tensor([f["attention_mask"] + [0] * (longest - len(f["attention_mask"]))
                                            for f in features]),
            "labels": torch.tensor([f["labels"] for f in features])}


def image_rows(rows: int = 32, num_labels: int = 3, seed: int = 0, size: int = 8):
    """1 x `size` x `size` images (8: the debug ViT's) with a class per image."""
    g = torch.Generator().manual_seed(seed)
    return datasets.Dataset.from_dict({"pixel_values": torch.randn(rows, 1, size, size, generator=g).tolist(),
                                       "labels": (torch.arange(rows) % num_labels).tolist()})


def image_collator(features: list[dict]) -> dict[str, torch.Tensor]:
    return {"pixel_values": torch.tensor([f["pixel_values"] for f in features]),
            "labels": torch.tensor([f["labels"] for f in features])}


PREFERENCE_VOCAB = 300  # sample_tokenizer's vocabulary: RewardTrainer aligns the model's pad id to it


def preference_rows(rows: int = 16, seed: int = 0) -> datasets.Dataset:
    """Tokenized preference pairs as RewardTrainer takes them (`chosen_ids`, `rejected_ids` of 4-11
    tokens, and a `margin` each), so that batches need padding."""
    g = torch.Generator().manual_seed(seed)

    def ids():
        return torch.randint(3, PREFERENCE_VOCAB, (int(torch.randint(4, 12, (1,), generator=g)),), generator=g).tolist()

    return datasets.Dataset.from_list([{"chosen_ids": ids(), "rejected_ids": ids(),
                                        "margin": float(torch.rand(1, generator=g))} for _ in range(rows)])


def reward_model():
    """A random Llama reward model: a sequence classifier with one label."""
    from hf_actcomp.debug import debug_model

    return debug_model("llama", seed=0, task="sequence_classification", num_labels=1, vocab_size=PREFERENCE_VOCAB)


def reward_config(output_dir: str, **overrides):
    """RewardConfig for the exactness runs: fp32, accumulation 2, the centring term on."""
    from trl import RewardConfig

    kwargs = dict(output_dir=output_dir, per_device_train_batch_size=4, per_device_eval_batch_size=4,
                  gradient_accumulation_steps=2, max_steps=4, logging_steps=1, learning_rate=1e-3, report_to=[],
                  save_strategy="no", eval_strategy="no", use_cpu=True, seed=0, bf16=False,
                  center_rewards_coefficient=0.01, disable_tqdm=True)
    kwargs.update(overrides)
    return RewardConfig(**kwargs)


def reward_run(trainer_cls, output_dir: str, config: dict | None = None, resume: str | None = None,
               eval_pairs: int = 6, **kwargs) -> dict:
    """Train `trainer_cls` (RewardTrainer or ActCompRewardTrainer, with `kwargs` such as plan=) on
    preference_rows for 4 steps (from the checkpoint `resume`, if given), then evaluate on
    `eval_pairs` pairs: the logged training entries and the evaluation's metrics."""
    trainer = trainer_cls(model=reward_model(), args=reward_config(output_dir, **(config or {})),
                          train_dataset=preference_rows(), eval_dataset=preference_rows(eval_pairs, seed=1),
                          processing_class=sample_tokenizer(), **kwargs)
    trainer.train(resume_from_checkpoint=resume)
    return trainer_results(trainer)


def dpo_rows(rows: int = 16, seed: int = 0) -> datasets.Dataset:
    """Preference pairs as text (prompt, chosen, rejected) over sample_tokenizer's words."""
    words = "def add return the pipeline splits model into stages import torch a b".split()
    g = torch.Generator().manual_seed(seed)

    def text(low: int, high: int) -> str:
        count = int(torch.randint(low, high, (1,), generator=g))
        return " ".join(words[int(i) % len(words)] for i in torch.randint(0, 100, (count,), generator=g))

    return datasets.Dataset.from_list([{"prompt": text(3, 6), "chosen": " " + text(2, 5), "rejected": " " + text(2, 5)}
                                       for _ in range(rows)])


def dpo_run(trainer_cls, output_dir: str, reference: str = "model", config: dict | None = None,
            resume: str | None = None, **kwargs) -> dict:
    """Train `trainer_cls` (DPOTrainer or ActCompDPOTrainer) on dpo_rows for 4 steps (fp32,
    accumulation 2; from the checkpoint `resume`, if given), then evaluate on 6 pairs. `reference`:
    "model" (a copy of the initial policy as `ref_model`), "precompute" (`precompute_ref_log_probs`)
    or "lora" (a LoRA policy, the reference its adapters disabled). The logged training entries and
    the evaluation's metrics."""
    import copy

    from trl import DPOConfig

    from hf_actcomp.debug import debug_model

    model = debug_model("llama", seed=0, vocab_size=PREFERENCE_VOCAB)
    if reference == "lora":
        from peft import LoraConfig

        kwargs["peft_config"] = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    settings = dict(output_dir=output_dir, per_device_train_batch_size=4, per_device_eval_batch_size=4,
                    gradient_accumulation_steps=2, max_steps=4, logging_steps=1, learning_rate=1e-3, report_to=[],
                    save_strategy="no", eval_strategy="no", use_cpu=True, seed=0, bf16=False, disable_tqdm=True,
                    precompute_ref_log_probs=reference == "precompute")
    args = DPOConfig(**{**settings, **(config or {})})
    trainer = trainer_cls(model=model, ref_model=copy.deepcopy(model) if reference == "model" else None, args=args,
                          train_dataset=dpo_rows(), eval_dataset=dpo_rows(6, seed=1),
                          processing_class=sample_tokenizer(), **kwargs)
    trainer.train(resume_from_checkpoint=resume)
    return trainer_results(trainer)


def trainer_results(trainer) -> dict:
    """After training: the logged training entries (without `comm/*`), the compression ratio at each
    logged step, and an evaluation's metrics (without timings)."""
    history = [h for h in trainer.state.log_history if "loss" in h]
    metrics = trainer.evaluate()
    return {"logs": [{k: v for k, v in h.items() if not k.startswith("comm/")} for h in history],
            "eval": {k: v for k, v in metrics.items() if "runtime" not in k and "per_second" not in k},
            "compression_ratio": [h.get("comm/compression_ratio") for h in history],
            "problem_type": getattr(trainer.model.config, "problem_type", None)}
