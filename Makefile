# posenc: `make demo` runs the main job, `make test` runs every test. Both set up a fresh
# machine first (scripts/bootstrap.sh) and build what is out of date.
PY        := .venv/bin/python
BUILD     := build
INSTALL   := $(BUILD)/install
MAX_JOBS  ?= 2
# pytest processes of make test and make test-sanitize (pytest-xdist's -n; 0: in make's own
# process, as `python -m pytest` without -n). At 2, the suite took 200 s against 281 s serial
# with warm caches here, 257 s against 266 s on a clean clone (inductor compiling cold).
TEST_JOBS ?= 2
export PYTHONPATH := $(CURDIR)/python

.PHONY: all setup build demo docs lint test test-cpp test-example test-python test-python-baseline test-install test-sanitize bench clean

all: build

setup:
	bash scripts/bootstrap.sh

$(BUILD)/build.ninja: CMakeLists.txt | setup
	cmake -S . -B $(BUILD) -G Ninja -DPython3_EXECUTABLE=$(CURDIR)/$(PY) \
	  -DPOSENC_INSTALL_PYTHON_LIB=ON -DCMAKE_INSTALL_PREFIX=$(CURDIR)/$(INSTALL)

build: setup $(BUILD)/build.ninja
	$(if $(POSENC_WITH_CUDA),cmake -S . -B $(BUILD) -DPOSENC_WITH_CUDA=$(POSENC_WITH_CUDA) > /dev/null)
	cmake --build $(BUILD) -j $(MAX_JOBS)
	cmake --install $(BUILD) > /dev/null

demo: build
	$(PY) -m posenc demo

# The reference site (docs/: Sphinx, MyST Markdown pages, autodoc, the C++ headers' comments,
# pictures drawn by docs/figures.py) as HTML in build/docs, with warnings as errors. Needs the
# built library (autodoc imports posenc). Open build/docs/index.html.
docs: setup
	$(PY) -m sphinx -W --keep-going -q -b html docs $(BUILD)/docs

# Python style and errors (ruff, configured in pyproject.toml). .clang-format describes the
# C++ style for editors; it is not enforced here.
lint: setup
	$(PY) -m ruff check python tests benchmarks scripts docs

test: build test-cpp test-example test-python test-python-baseline test-install

test-cpp:
	ctest --test-dir $(BUILD) --output-on-failure

test-example:
	bash tests/cpp/run_example.sh $(CURDIR)/$(INSTALL) $(CURDIR)/$(PY)

test-python:
	$(PY) -m pytest tests/python -q -p no:cacheprovider -n $(TEST_JOBS)

# The core CPU tests again with the baseline kernels forced (POSENC_CPU_CAPABILITY=default:
# the build without AVX2 that a CPU without AVX2 runs; csrc/ops/common/cpu/cpu_capability.h). The
# dropout tests compare its masks with a NumPy Philox, bit for bit. torch.compile and
# opcheck tests are left out (tracing, not the kernels' arithmetic: 80 of 120 s).
BASELINE_TESTS := test_add_position_dropout test_add_position_dropout_bits \
  test_add_position_saved_mask test_positional_encoding test_rope test_rope_cos_sin \
  test_rope_append_kv test_rope_append_kv_fp8
test-python-baseline:
	POSENC_CPU_CAPABILITY=default $(PY) -c "import torch, posenc; \
	  c = torch.ops.posenc.cpu_capability(); assert c == 'default', c"
	POSENC_CPU_CAPABILITY=default $(PY) -m pytest -q -p no:cacheprovider -n $(TEST_JOBS) \
	  -k "not cuda and not compile and not opcheck" $(patsubst %,tests/python/%.py,$(BASELINE_TESTS))

# One CPU-only build: the wheel built by pip with the CUDA toolkit hidden, installed into a
# fresh venv and run; checks its torch pin and the RUNPATH of both installed libraries.
test-install:
	bash tests/python/run_pip_install.sh $(CURDIR)/$(PY) $(CURDIR)/$(INSTALL)

# AddressSanitizer + UBSan: a CPU-only libposenc built with -fsanitize=address,undefined in
# build-sanitize/ under the GoogleTest binary and the CPU pytest suite; stops at the first
# report. Leak checking is off (CPython and torch leak by design). CONTRIBUTING.md, "Sanitizers".
test-sanitize: setup
	TEST_JOBS=$(TEST_JOBS) bash scripts/sanitize.sh $(CURDIR)/$(PY)

# Issue 37's whole table in one run (benchmarks/bench_table.py): every CPU op against its memory
# floor (clone of the same bytes), eager PyTorch and torch.compile, under the allocator the process
# has (tcmalloc: LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 make bench).
# BENCH_ARGS passes options, e.g. BENCH_ARGS="--json bench.json" or "--no-compile --only rope".
bench: build
	$(PY) benchmarks/bench_table.py $(BENCH_ARGS)

clean:
	rm -rf $(BUILD) build-sanitize python/posenc/lib
