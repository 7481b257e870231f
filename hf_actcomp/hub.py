"""Model cards, run results and curves next to a saved model, and pushing the folder to the Hub.

Every save of a trained model (pipeline `save_pretrained`, `ActCompTrainer.save_model` and its
checkpoints, the recipes) writes, beside the weights and `actcomp_config.json`:

    actcomp_results.json   what the run measured: bytes per boundary, errors, seconds, eval losses
    training_curves.png    training / eval loss and bytes per step per boundary (when logged)
    README.md              the model card, rendered from `model_cards/` with huggingface_hub

`hf-actcomp card DIR` re-renders the card from those files. Uploads go through
`huggingface_hub.HfApi` (create_repo + upload_folder): token, endpoint and offline mode come from
the usual places (`HF_TOKEN`, `huggingface-cli login`, `HF_ENDPOINT`, `HF_HUB_OFFLINE`).
"""

from __future__ import annotations

import json
import logging
import os
import re
from importlib import resources
from typing import Any

from huggingface_hub import EvalResult, HfApi, ModelCard, ModelCardData
from huggingface_hub import constants as hub_constants

from .auto import bandwidth_text
from .codecs import CODECS
from .curves import CURVES_NAME, plot_curves
from .dp.base import HOOKS
from .plan import CONFIG_NAME, Compression, Plan
from .run_results import RESULTS_NAME, load_results, save_results

__all__ = [
    "CARD_NAME",
    "CURVES_NAME",
    "RESULTS_NAME",
    "TEMPLATE_NAME",
    "hub_constants",
    "load_results",
    "model_card",
    "plan_compressions",
    "plot_curves",
    "push_to_hub",
    "save_results",
    "save_run",
    "write_model_card",
]

logger = logging.getLogger(__name__)

CARD_NAME = "README.md"
TEMPLATE_NAME = "actcomp_model_card.md"

# Tags of the methods that are not codecs (a codec's tag is its `hub_tag`); any other name (a
# data-parallel hook of your own) is its own tag. Only the methods a run used are shown.
_METHOD_TAGS = {"aqsgd": "aq-sgd", "ef": "error-feedback", "ef21": "ef21"}
_CITATIONS = {
    "aqsgd": """@inproceedings{wang2022aqsgd,
  title={Fine-tuning Language Models over Slow Networks using Activation Compression with Guarantees},
  author={Wang, Jue and Yuan, Binhang and Rimanic, Luka and He, Yongjun and Dao, Tri and Chen, Beidi and R{\\'e}, Christopher and Zhang, Ce},
  booktitle={Advances in Neural Information Processing Systems},
  year={2022},
  eprint={2206.01299}
}""",
    "activations": """@article{rudakov2024activations,
  title={Activations and Gradients Compression for Model-Parallel Training},
  author={Rudakov, Mikhail and Beznosikov, Aleksandr and Kholodov, Yaroslav and Gasnikov, Alexander},
  year={2024},
  eprint={2401.07788}
}""",
    "dgc": """@inproceedings{lin2018dgc,
  title={Deep Gradient Compression: Reducing the Communication Bandwidth for Distributed Training},
  author={Lin, Yujun and Han, Song and Mao, Huizi and Wang, Yu and Dally, William J.},
  booktitle={International Conference on Learning Representations},
  year={2018},
  eprint={1712.01887}
}""",
    "qsgd": """@inproceedings{alistarh2017qsgd,
  title={QSGD: Communication-Efficient SGD via Gradient Quantization and Encoding},
  author={Alistarh, Dan and Grubic, Demjan and Li, Jerry and Tomioka, Ryota and Vojnovic, Milan},
  booktitle={Advances in Neural Information Processing Systems},
  year={2017},
  eprint={1610.02132}
}""",
    "marsit": """@inproceedings{wu2022marsit,
  title={Sign Bit is Enough: A Learning Synchronization Framework for Multi-hop All-reduce with Ultimate Compression},
  author={Wu, Feijie and He, Shiqi and Guo, Song and Qu, Zhihao and Wang, Haozhao and Zhuang, Weihua and Zhang, Jie},
  booktitle={Design Automation Conference},
  year={2022},
  eprint={2204.06787}
}""",
    "powersgd": """@inproceedings{vogels2019powersgd,
  title={PowerSGD: Practical Low-Rank Gradient Compression for Distributed Optimization},
  author={Vogels, Thijs and Karimireddy, Sai Praneeth and Jaggi, Martin},
  booktitle={Advances in Neural Information Processing Systems},
  year={2019},
  eprint={1905.13727}
}""",
    "diloco": """@article{douillard2023diloco,
  title={DiLoCo: Distributed Low-Communication Training of Language Models},
  author={Douillard, Arthur and Feng, Qixuan and Rusu, Andrei A. and Chhaparia, Rachita and Donchev, Yani and Kuncoro, Adhiguna and Ranzato, Marc'Aurelio and Szlam, Arthur and Shen, Jiajun},
  journal={arXiv preprint arXiv:2311.08105},
  year={2023}
}""",
    "ef_sign": """@inproceedings{karimireddy2019ef,
  title={Error Feedback Fixes SignSGD and other Gradient Compression Schemes},
  author={Karimireddy, Sai Praneeth and Rebjock, Quentin and Stich, Sebastian and Jaggi, Martin},
  booktitle={International Conference on Machine Learning},
  year={2019},
  eprint={1901.09847}
}""",
}


# ----------------------------------------------------------------------------- the card
def model_card(directory: str | os.PathLike, *, repo_id: str | None = None, base_model: str | None = None,
               datasets: str | list[str] | None = None) -> ModelCard:
    """Render the model card of a saved run from its plan, results and config (nothing is
    written; see `write_model_card`)."""
    directory = os.fspath(directory)
    plan = Plan.from_pretrained(directory)
    results = load_results(directory)
    adapter = _read_json(os.path.join(directory, "adapter_config.json"))
    config = _read_json(os.path.join(directory, "config.json"))
    base_model = base_model or results.get("base_model") or (adapter or {}).get("base_model_name_or_path")
    base_model = base_model if _is_repo_id(base_model) else None
    datasets = datasets or results.get("datasets")
    datasets = [datasets] if isinstance(datasets, str) else datasets
    name = repo_id or results.get("repo_id") or os.path.basename(os.path.abspath(directory))
    metrics = results.get("metrics", {})
    card_data = ModelCardData(
        model_name=name.split("/")[-1],
        library_name="peft" if adapter else "transformers",
        base_model=base_model,
        datasets=datasets,
        tags=_tags(plan, adapter is not None),
        pipeline_tag="text-generation",
        eval_results=_eval_results(metrics, datasets) or None,
    )
    usage, note = _usage(plan, repo_id or "path/to/this/model", adapter is not None, metrics)
    template = resources.files("hf_actcomp.model_cards").joinpath(TEMPLATE_NAME).read_text(encoding="utf-8")
    stats = results.get("stats", {})
    return ModelCard.from_template(
        card_data, template_str=template,
        model_name=name,
        summary=_summary(plan, config, adapter),
        plan_table=_plan_table(plan, results.get("blocks")),
        communication_table=_communication_table(stats),
        timing_table=_timing_table(stats),
        evaluation_table=_evaluation_table(metrics),
        curves=CURVES_NAME if os.path.isfile(os.path.join(directory, CURVES_NAME)) else None,
        usage=usage, inference_note=note,
        versions=_versions(adapter is not None),
        citations="\n".join(_citations(plan)),
    )


def write_model_card(directory: str | os.PathLike, **kwargs: Any) -> ModelCard:
    """Render the card (`model_card`) and write it to `directory/README.md`."""
    card = model_card(directory, **kwargs)
    card.save(os.path.join(directory, CARD_NAME))
    return card


def save_run(directory: str | os.PathLike, *, stats: dict | None = None, metrics: dict | None = None,
             log_history: list[dict] | None = None, **extra: Any) -> None:
    """Results, curves and card of a run whose model and plan are already in `directory`."""
    save_results(directory, stats=stats, metrics=metrics, log_history=log_history, **extra)
    if log_history:
        plot_curves(directory, log_history)
    write_model_card(directory)


# ----------------------------------------------------------------------------- push
def push_to_hub(directory: str | os.PathLike, repo_id: str, *, private: bool | None = None,
                token: str | bool | None = None, commit_message: str = "Upload model trained with hf-actcomp",
                revision: str | None = None) -> Any:
    """Create `repo_id` if needed and upload `directory` (card re-rendered with the repo id).

    Fails at once, with the reason, when the Hub is switched off (`HF_HUB_OFFLINE=1`)."""
    if hub_constants.HF_HUB_OFFLINE:
        raise RuntimeError(
            f"Cannot push {directory!s} to {repo_id!r}: HF_HUB_OFFLINE is set. Unset it (and log in with "
            "`hf auth login` or HF_TOKEN) to upload; the folder is complete and can be pushed later with "
            "hf_actcomp.hub.push_to_hub(dir, repo_id)."
        )
    if os.path.isfile(os.path.join(directory, CONFIG_NAME)):
        write_model_card(directory, repo_id=repo_id)
    api = HfApi()
    url = api.create_repo(repo_id, token=token, private=private, exist_ok=True)
    return api.upload_folder(repo_id=url.repo_id, folder_path=os.fspath(directory), commit_message=commit_message,
                             token=token, revision=revision)


# ----------------------------------------------------------------------------- card pieces
def _read_json(path: str) -> dict | None:
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _is_repo_id(name: str | None) -> bool:
    """A Hub model id (`gpt2`, `user/model`), not a local path or an empty name."""
    return bool(name) and not os.path.exists(name) and re.fullmatch(r"[\w.-]+(/[\w.-]+)?", name) is not None


def _methods(plan: Plan) -> dict[str, str]:
    """The methods a run used (wrapper, codecs, feedback, data-parallel hook), in order, each with
    its Hub tag: a codec's and a data-parallel hook's from their registries, the others' from `_METHOD_TAGS`."""
    methods: dict[str, str] = {}
    for c in plan_compressions(plan):
        warm_up = c.first_visit.codec_name if c.method == "aqsgd" and isinstance(c.first_visit, Compression) else "none"
        for m, is_codec in ((c.method, c.method in CODECS), (c.codec_name, True), (c.feedback, False), (warm_up, True)):
            if m != "none" and m not in methods:
                methods[m] = (CODECS[m].hub_tag or m) if is_codec else _METHOD_TAGS.get(m, m)
    if plan.data_parallel > 1:
        hook = plan.dp_hook()[0]
        if hook != "allreduce":
            methods.setdefault(hook, getattr(HOOKS.get(hook), "hub_tag", None) or hook)
    return methods


def plan_compressions(plan: Plan) -> list[Compression]:
    """Every boundary codec the plan uses, forward before backward, each once."""
    found: list[Compression] = []
    for c in [plan.forward_at(b) for b in range(max(plan.num_stages - 1, 1))] + \
             [plan.backward_at(b) for b in range(max(plan.num_stages - 1, 1))]:
        if c not in found:
            found.append(c)
    return found


def _tags(plan: Plan, adapter: bool) -> list[str]:
    tags = ["hf-actcomp", "pipeline-parallel"] + list(_methods(plan).values())
    if plan.data_parallel > 1:
        tags.append("data-parallel")
    if adapter:
        tags += ["peft", "lora"]
    return tags


def _citations(plan: Plan) -> list[str]:
    keys = []
    methods = _methods(plan)
    if "aqsgd" in methods:
        keys.append("aqsgd")
    if any(m in methods for m in ("quantize", "topk", "randk", "ef", "ef21")):
        keys.append("activations")
    keys += [m for m in methods if m in _CITATIONS and m not in keys]
    return [_CITATIONS[k] for k in keys]


def _describe_auto(plan: Plan) -> str:
    """`Plan.auto`'s row of the card: the quality level and what it measured per boundary."""
    auto = plan.autotune
    text = f"`Plan.auto` (quality {auto.quality}" + (f", re-measured every {auto.adapt_every} steps" if auto.adapt_every
                                                    else "") + ")"
    decision = auto.decision
    if decision is None:
        return text + ", not measured yet"
    links = decision["measurements"]["links"]
    measured = "; ".join(f"boundary {b}: {bandwidth_text(link['forward'])} forward, {bandwidth_text(link['backward'])} "
                         f"backward, {link['forward']['rtt_ms']:.3g} ms RTT" for b, link in enumerate(links))
    return (f"{text} from measured links ({measured}) and {decision['compute_seconds'] * 1e3:.1f} ms of compute per "
            "micro-batch")


def _summary(plan: Plan, config: dict | None, adapter: dict | None) -> str:
    what = "A LoRA adapter" if adapter else "A causal language model"
    family = f" ({config['model_type']})" if config and "model_type" in config else ""
    replicas = f" x {plan.data_parallel} data-parallel replicas" if plan.data_parallel > 1 else ""
    if plan.per_boundary:
        sent = "with a codec chosen per boundary (below)"
    else:
        sent = (f"with activations sent between stages as `{plan.forward.describe()}` and activation gradients "
                f"as `{plan.backward.describe()}`")
    return f"{what}{family} fine-tuned with hf-actcomp: split into {plan.num_stages} pipeline stages{replicas}, {sent}."


def _plan_table(plan: Plan, blocks: list | None) -> str:
    rows = [("pipeline stages", str(plan.num_stages) + (
        f" (blocks {', '.join(f'[{a}, {b})' for a, b in blocks)})" if blocks else "")),
        ("micro-batches, schedule", f"{plan.micro_batches}, {plan.schedule}"),
        ("forward (activations)", f"`{plan.forward.describe()}`"),
        ("backward (activation gradients)", f"`{plan.backward.describe()}`")]
    if plan.per_boundary:
        rows[2:] = [row for b in range(plan.num_stages - 1) for row in (
            (f"boundary {b} forward", f"`{plan.forward_at(b).describe()}`"),
            (f"boundary {b} backward", f"`{plan.backward_at(b).describe()}`"))]
    if plan.autotune is not None:
        rows.append(("codecs chosen by", _describe_auto(plan)))
    if plan.uses_aqsgd:
        m = plan.memory
        rows.append(("AQ-SGD memory", f"{m.num_samples} samples, {m.dtype}, on {m.store}"))
    if plan.diloco is not None:
        rows.append(("data parallel", f"{plan.data_parallel} replicas, {_describe_diloco(plan.diloco)}"))
    elif plan.data_parallel > 1:
        hook, params = plan.dp_hook()
        rows.append(("data parallel", f"{plan.data_parallel} replicas, gradients by `{hook}` {params or ''}".strip()))
    if plan.tie_compression is not None:
        rows.append(("tied embedding rows", f"`{plan.tie_compression.describe()}` (rows as deltas, gradient rows "
                                            "with error feedback)"))
    return _table(("setting", "value"), rows)


def _describe_diloco(config) -> str:
    """DiLoCo's settings in words, for the card's plan table."""
    momentum = (f", {'Nesterov ' if config.nesterov else ''}momentum {config.outer_momentum:g}"
                if config.outer_momentum else "")
    codec = (f"`{config.compression.describe()}` with error feedback" if config.compression is not None
             else "fp32 (exact)")
    extras = [f"at least {config.min_replicas} per sync" if config.min_replicas else "",
              "stages staggered" if config.stagger else ""]
    return (f"DiLoCo: an outer step every {config.sync_every} optimizer steps (outer SGD lr {config.outer_lr:g}"
            f"{momentum}), pseudo-gradients as {codec}" + "".join(f"; {e}" for e in extras if e))


def _communication_table(stats: dict) -> str | None:
    channels = stats.get("channels") or {}
    if not channels:
        return None
    rows = [(name, f"{c['bytes_sent']:,}", f"{c['bytes_uncompressed']:,}", f"{c['compression_ratio']:.2f}x",
             f"{c['relative_error']:.4f}") for name, c in sorted(channels.items())]
    for name, c in sorted((stats.get("categories") or {}).items()):
        if name not in ("activations", "activation_gradients") and c["bytes_sent"]:
            rows.append((name, f"{c['bytes_sent']:,}", f"{c['bytes_uncompressed']:,}",
                         f"{c['compression_ratio']:.2f}x", "lossless" if c["compression_ratio"] == 1 else ""))
    rows.append(("**all traffic**", f"{stats['bytes_sent']:,}", f"{stats['bytes_uncompressed']:,}",
                 f"{stats['compression_ratio']:.2f}x", ""))
    return _table(("boundary / traffic", "bytes sent", "uncompressed", "ratio", "relative error"), rows)


def _timing_table(stats: dict) -> str | None:
    stages = stats.get("stages") or {}
    if not stages:
        return None
    rows = [(str(s), str(t.get("steps", "")), f"{t['seconds_computing']:.1f}", f"{t['seconds_waiting']:.1f}")
            for s, t in sorted(stages.items(), key=lambda kv: int(kv[0]))]
    return _table(("stage", "steps", "seconds computing", "seconds waiting"), rows)


def _evaluation_table(metrics: dict) -> str | None:
    loss = metrics.get("eval_loss")
    if loss is None:
        return None
    rows = [("with the codec at inference", f"{loss:.4f}", f"{metrics.get('eval_perplexity', float('nan')):.2f}")]
    if metrics.get("eval_plain_loss") is not None:
        rows.append(("without compression", f"{metrics['eval_plain_loss']:.4f}",
                     f"{metrics.get('eval_plain_perplexity', float('nan')):.2f}"))
    return _table(("evaluation", "loss", "perplexity"), rows)


def _eval_results(metrics: dict, datasets) -> list[EvalResult]:
    dataset = datasets[0] if isinstance(datasets, list) and datasets else datasets
    out = []
    for key, metric in (("eval_loss", "loss"), ("eval_perplexity", "perplexity"),
                        ("eval_plain_loss", "loss"), ("eval_plain_perplexity", "perplexity")):
        if metrics.get(key) is not None:
            plain = "plain" in key
            out.append(EvalResult(task_type="text-generation", dataset_type=dataset or "custom",
                                  dataset_name=dataset or "held-out evaluation set", metric_type=metric,
                                  metric_value=round(float(metrics[key]), 4),
                                  metric_name=f"{metric} ({'no compression' if plain else 'codec at inference'})"))
    return out


def _usage(plan: Plan, repo: str, adapter: bool, metrics: dict) -> tuple[str, str | None]:
    load = (f'from peft import AutoPeftModelForCausalLM\n\nmodel = AutoPeftModelForCausalLM.from_pretrained("{repo}")'
            if adapter else
            f'from transformers import AutoModelForCausalLM\n\nmodel = AutoModelForCausalLM.from_pretrained("{repo}")')
    forwards = {plan.forward_at(b).describe() for b in range(max(plan.num_stages - 1, 1))}
    if forwards == {"none"} or plan.num_stages == 1:
        return load, None
    usage = (load + "\n\n# As trained: the same stage boundaries, compressed (the plan saved with the model)\n"
             "import hf_actcomp\nwith hf_actcomp.compressed_inference(model) as inf:\n"
             "    out = inf.generate(input_ids, max_new_tokens=20)")
    note = (f"The model was trained with `{'`, `'.join(sorted(forwards))}` activations between stages. Plain "
            "`from_pretrained` runs it without compression; `compressed_inference` runs it with the codec it "
            "was trained with (models trained with TopK can need it).")
    if metrics.get("eval_loss") is not None and metrics.get("eval_plain_loss") is not None:
        note += (f" Measured on the evaluation set: loss {metrics['eval_loss']:.4f} with the codec, "
                 f"{metrics['eval_plain_loss']:.4f} without.")
    return usage, note


def _versions(adapter: bool) -> str:
    import accelerate
    import huggingface_hub
    import torch
    import transformers

    from .version import __version__

    lines = [f"- hf-actcomp {__version__}", f"- transformers {transformers.__version__}",
             f"- torch {torch.__version__}", f"- accelerate {accelerate.__version__}",
             f"- huggingface_hub {huggingface_hub.__version__}"]
    if adapter:
        import peft

        lines.append(f"- peft {peft.__version__}")
    return "\n".join(lines)


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)
