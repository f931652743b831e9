"""Shared fixtures: tiny synthetic checkpoints of each family, made once per test session."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

# No test may depend on timings: the default backend follows the speed_rank rule here (glmcore/autoselect.py
# is tested with fake timings in test_autoselect.py), and a developer's pin does not leak in.
os.environ["GLMCORE_AUTOSELECT"] = "0"
os.environ.pop("GLMCORE_BACKEND", None)

SHARED_MODELS = Path(__file__).resolve().parents[2] / "shared" / "models"

# The heavy integration cases, marked `slow` here in one place so the README's test command stays under
# 10 minutes on 2 cores (pyproject's addopts deselect them; .ci/run runs them after it with `-m slow`).
# Each took 5-141 s of a 9-minute full run (--durations=50); what they cover is also covered, smaller, by the
# default run: backend conformance at one configuration, the tp/replica plumbing, the harness model.
SLOW = {
    "tests/test_conformance.py::test_ready_backend_conforms[ascend_npu]",            # torch graph compiles
    "tests/test_conformance.py::test_ready_backend_conforms[openvino_amx]",
    "tests/test_parallel.py::test_ascend_npu_graph_mode_keeps_the_collectives_in_one_compiled_step",
    "tests/test_parallel.py::test_four_ranks_on_kv_groups_that_do_not_divide_evenly",
    "tests/test_parallel.py::test_glmcore_run_tp2_answers_like_one_rank_and_leaves_no_process",
    "tests/test_parallel.py::test_glmcore_bench_tp2_reports_every_ranks_memory",
    "tests/test_parallel.py::test_ascend_npu_eager_two_ranks_conform",
    "tests/test_parallel.py::test_followers_exit_when_rank_0_is_killed",
    "tests/test_parallel.py::test_32b_width_checkpoint_runs_on_two_ranks",                # writes 1 GB
    "tests/test_cpu_int4.py::test_conformance_suite_all_variants",
    "tests/test_ray_serve.py::test_two_replicas_answer_survive_a_killed_replica_and_leave_nothing",
    "tests/test_bench.py::test_run_all_smoke",                                       # CI runs every bench anyway
    "tests/test_bench.py::test_bench_vs_runs_both_backends_alternately",
    "tests/test_eval.py::test_harness_multiple_choice_by_name_on_torch",
    "tests/test_eval.py::test_harness_multiple_choice_on_cpu_int4_with_prefix_reuse",
    "tests/test_eval.py::test_cli_tasks_pass_harness_options_through",
    "tests/test_eval.py::test_harness_chat_template_generation",
    "tests/test_eval.py::test_harness_generation_and_rolling_on_torch",
    # 12-42 s each in a random-order run of the rest (compile caches cold for them there)
    "tests/test_conformance.py::test_ready_backend_conforms[tpu_bm1684x]",
    "tests/test_ascend_npu.py::test_batch_matches_the_single_sequence_reference_in_mixed_steps",
    "tests/test_glm4_0414.py::test_make_model_32b_width_with_few_layers",
    "tests/test_cpu_int4.py::test_benchmark_smoke",                                  # CI runs every bench anyway
}


@pytest.hookimpl(tryfirst=True)          # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid in SLOW:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def make_tiny(tmp_path_factory):
    """make_tiny(family, fmt="safetensors", **kw) -> checkpoint dir (cached per arguments)."""
    from glmcore.synth import make_model
    made: dict = {}

    def make(family: str, fmt: str = "safetensors", **kw) -> Path:
        key = (family, fmt, tuple(sorted(kw.items())))
        if key not in made:
            out = tmp_path_factory.mktemp(f"{family}-{fmt}")
            make_model(family, "tiny", out, fmt=fmt, **kw)
            made[key] = out
        return made[key]

    return make


@pytest.fixture(scope="session")
def shared_models() -> Path:
    if not SHARED_MODELS.is_dir():
        pytest.skip(f"real tokenizer files not found at {SHARED_MODELS}")
    return SHARED_MODELS
