# The two commands of the README: `make demo` (the main job) and `make test` (everything CI runs).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: demo test venv testenv testenv-gpu-operator testenv-prometheus testenv-upgrade-libs testenv-node lint typecheck unit proptest-long bench lock
.PHONY: compat testenv-versions testenv-versions-background testenv-background soak

# The Kubernetes versions of the test control plane, one module file each
# (testenv/kube/<minor>.mod): the whole suite runs on the default, the compatibility suite
# (tests/compat.py, marker compat) on every one.
KUBE_VERSIONS := $(sort $(patsubst testenv/kube/%.mod,%,$(wildcard testenv/kube/*.mod)))
KUBE_DEFAULT := 1.36
COMPAT_VERSIONS := $(filter-out $(KUBE_DEFAULT),$(KUBE_VERSIONS))

venv: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $@

# helmrender, and etcd, kube-apiserver and kube-controller-manager of the run's version
# ($SHARED_SVC_KUBE_VERSION, default 1.36); testenv-versions: of every version.
testenv:
	nice -n 10 bash testenv/helmrender/build.sh >/dev/null
	nice -n 10 bash testenv/build.sh $${SHARED_SVC_KUBE_VERSION:-$(KUBE_DEFAULT)} >/dev/null

testenv-versions: testenv
	for v in $(KUBE_VERSIONS); do nice -n 10 bash testenv/build.sh $$v >/dev/null || exit 1; done

# make test's first step: the other versions' control planes, built one after the other in
# the background at the lowest priority (nice -n 19) while the foreground builds and the
# whole suite run, so that a cold machine's idle core builds them; the compatibility loop's
# own build.sh of each version waits for the one in flight (flock) and then finds it
# cached, or builds it itself, and reports, if the background one failed. Its log:
# $(TESTENV_VERSIONS_LOG).
TESTENV_VERSIONS_LOG ?= .testenv-versions.log
testenv-versions-background:
	( for v in $(COMPAT_VERSIONS); do nice -n 19 bash testenv/build.sh $$v >/dev/null || exit 1; done ) \
	  >$(TESTENV_VERSIONS_LOG) 2>&1 </dev/null &

# make test's second step: the parties' builds (the default control plane and helmrender,
# Prometheus and prometheus-operator, gpu-operator, the upgrade libs; and the real node's
# chain: its programs, the base image, the project's image) started in the background at
# nice -n 10, in two chains, and returned from at once (the host's packages first, in the
# foreground: apt). The suite's fixtures run the same cached builds when they need a party
# (testenv/builds.py): one still in flight is waited for (flock), one done is a cache hit,
# one that failed is built again and reports. So on a cold machine the venv, lint, types
# and the whole suite run while the parties build, and the node's downloads (debootstrap
# first, then modules and packages) overlap the Go builds; its programs wait for the
# default control plane (flock) and reuse its compiled packages. Logs:
# $(TESTENV_BACKGROUND_LOG) and $(TESTENV_NODE_LOG).
TESTENV_BACKGROUND_LOG ?= .testenv-background.log
TESTENV_NODE_LOG ?= .testenv-node.log
testenv-background:
	bash testenv/node/host-packages.sh
	( nice -n 10 bash testenv/helmrender/build.sh; \
	  nice -n 10 bash testenv/build.sh $${SHARED_SVC_KUBE_VERSION:-$(KUBE_DEFAULT)}; \
	  nice -n 10 bash testenv/prometheus/build.sh; \
	  nice -n 10 bash testenv/gpu-operator/build.sh; \
	  nice -n 10 bash testenv/prometheus-operator/build.sh; \
	  nice -n 10 bash testenv/upgrade-libs/build.sh ) >$(TESTENV_BACKGROUND_LOG) 2>&1 </dev/null &
	( base=$$(nice -n 10 bash testenv/node/base.sh) \
	  && nice -n 10 bash testenv/build.sh $${SHARED_SVC_KUBE_VERSION:-$(KUBE_DEFAULT)} >/dev/null \
	  && programs=$$(nice -n 10 bash testenv/node/build.sh) \
	  && nice -n 10 bash testenv/node/images.sh "$$programs" "$$base" ) >$(TESTENV_NODE_LOG) 2>&1 </dev/null &

# The real gpu-operator for the tests marked gpu_operator (its own cached build; heavy when cold).
testenv-gpu-operator:
	nice -n 10 bash testenv/gpu-operator/build.sh >/dev/null

# The real Prometheus for the tests marked prometheus (its own cached build; minutes when cold),
# and the real prometheus-operator (its own module and cached build).
testenv-prometheus:
	nice -n 10 bash testenv/prometheus/build.sh >/dev/null
	nice -n 10 bash testenv/prometheus-operator/build.sh >/dev/null

# The real upgrade state machine of k8s-operator-libs for the tests marked upgrade_libs (its
# own cached build; minutes when cold).
testenv-upgrade-libs:
	nice -n 10 bash testenv/upgrade-libs/build.sh >/dev/null

# The real node for the tests marked node (testenv/node/): Debian's packages (apt, once), then
# its cached builds: kubelet & co., containerd, CNI plugins, helm; the base image; the
# project's image from the Dockerfile (a cold build takes about 20 minutes).
testenv-node:
	bash testenv/node/host-packages.sh
	bash -ec 'programs=$$(nice -n 10 bash testenv/node/build.sh); base=$$(nice -n 10 bash testenv/node/base.sh); \
	  nice -n 10 bash testenv/node/images.sh "$$programs" "$$base" >/dev/null'

# requirements.lock, the image's dependencies pinned with hashes, from pyproject.toml
# (pip-tools; keeps the pins that still fit, UPGRADE=1 takes the newest allowed).
# tests/test_packaging.py fails while it is stale.
lock: venv
	$(BIN)/pip install -q 'pip-tools>=7.4,<8'
	$(BIN)/python scripts/lock.py $(if $(UPGRADE),--upgrade)

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: venv
	$(BIN)/mypy

# make test: the whole suite on the default version, then the compatibility suite on the others.
test: testenv-versions-background testenv-background venv lint typecheck testenv
	HYPOTHESIS_PROFILE=$${HYPOTHESIS_PROFILE:-ci} $(BIN)/pytest
	for v in $(COMPAT_VERSIONS); do \
	  nice -n 10 bash testenv/build.sh $$v >/dev/null || exit 1; \
	  HYPOTHESIS_PROFILE=$${HYPOTHESIS_PROFILE:-ci} $(BIN)/pytest -m compat --kube-version $$v || exit 1; \
	done

# The soak (tests/soak/): a seeded life of the cluster with faults on the real parties, every
# invariant checked after every step; the same SEED replays it (make test runs a bounded one,
# tests/test_soak.py). BUDGET: seconds at most.
STEPS ?= 10000
SEED ?= 1
BUDGET ?= 86400
soak: venv testenv testenv-gpu-operator testenv-upgrade-libs
	$(BIN)/python -m tests.soak --steps $(STEPS) --seed $(SEED) --budget $(BUDGET)

# The compatibility suite alone, on every version (make test runs it too).
compat: venv testenv-versions testenv-gpu-operator
	for v in $(KUBE_VERSIONS); do $(BIN)/pytest -m compat --kube-version $$v || exit 1; done

# make demo GPU_OPERATOR=1: next to the real gpu-operator (its build takes minutes once).
# make demo NODE=1: the chart and the image on the real node (testenv/node/; built once).
demo: venv testenv $(if $(NODE),testenv-node)
	$(BIN)/python -m testenv demo $(if $(GPU_OPERATOR),--with-gpu-operator) $(if $(NODE),--node)

proptest-long: venv
	HYPOTHESIS_PROFILE=long $(BIN)/pytest proptests

bench: venv testenv
	$(BIN)/python benchmarks/bench_plan.py
	$(BIN)/python benchmarks/bench_controller.py
	$(BIN)/python benchmarks/bench_memory.py --before fce0ce2
	$(BIN)/python benchmarks/bench_upgrade.py
	$(BIN)/python benchmarks/bench_fleet.py --world both
