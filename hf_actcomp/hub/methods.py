"""Which methods a plan uses, and the Hub tags and BibTeX entries the card gives them.

Kept apart from the card's layout so that a new codec, feedback or data-parallel hook shows up on
the card by registering a tag or a citation here, without touching how the card is rendered.
"""

from __future__ import annotations

from ..codecs import CODECS
from ..dp.base import HOOKS
from ..plan import Compression, Plan

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


def used_methods(plan: Plan) -> dict[str, str]:
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


def card_tags(plan: Plan, adapter: bool) -> list[str]:
    """The card's tags: the library, the methods used, data parallelism and PEFT."""
    tags = ["hf-actcomp", "pipeline-parallel"] + list(used_methods(plan).values())
    if plan.data_parallel > 1:
        tags.append("data-parallel")
    if adapter:
        tags += ["peft", "lora"]
    return tags


def card_citations(plan: Plan) -> list[str]:
    """BibTeX of the methods the plan used: AQ-SGD and the activation-compression paper first."""
    keys = []
    methods = used_methods(plan)
    if "aqsgd" in methods:
        keys.append("aqsgd")
    if any(m in methods for m in ("quantize", "topk", "randk", "ef", "ef21")):
        keys.append("activations")
    keys += [m for m in methods if m in _CITATIONS and m not in keys]
    return [_CITATIONS[k] for k in keys]

