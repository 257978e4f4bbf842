"""Shared fixtures: the real MNIST folder beside the repository (../shared/data/mnist), and
the `float32_matmuls` marker.

JAX runs float32 matmuls and convolutions as TF32 on a GPU by default (about 1e-3
relative error), full float32 on a CPU. A test that compares two formulations, ensemble
members or a plain reference at float32 tolerances carries the marker (on the test, or
`pytestmark` for a module, which also covers its module-scoped fixtures): it then runs with
`jax_default_matmul_precision='highest'` set globally, so that every thread (a test
server's too) computes at full float32 on any backend.

Compilation dominates the suite's time on a CPU, and many tests (and the commands they
run in subprocesses) compile the same programs: JAX's persistent compilation cache, in a
folder the suite owns (tests/.jax_cache/CPU, git-ignored; emptied at the start of a run
once it holds 2 GiB), which the pytest-xdist workers and every subprocess inherit
through the environment. Shared within a run, and kept between runs: a run after an edit
recompiles only the programs the edit changed (JAX keys an entry by the program, the
flags and its version). One folder per CPU model and instruction set: XLA refuses, with
an error line, an executable compiled for another CPU's features. CAPSJAX_TEST_JAX_CACHE=fresh gives a run a
cache of its own, empty at the start and removed at the end (a clean clone, as CI has
it). The same way the processes
inherit glibc's huge-pages tunable (below).

Bytecode likewise: the suite writes Python's bytecode caches (__pycache__, git-ignored) even
where PYTHONDONTWRITEBYTECODE is set, as it is on the CI machines, for itself, its workers
and their subprocesses. Without them each of the suite's ~150 processes compiled capsjax's
modules and rewrote the tests' asserts again (0.5 s a command line, 2 s a worker's
collection on a Zen 3).
"""
import atexit
import contextlib
import importlib.util
import os
import shutil
import sys
import tempfile

sys.dont_write_bytecode = False
os.environ.pop('PYTHONDONTWRITEBYTECODE', None)

CACHE_LIMIT_BYTES = 2 << 30


def _folder_bytes(folder: str) -> int:
  return sum(entry.stat().st_size for entry in os.scandir(folder) if entry.is_file()) if os.path.isdir(folder) else 0


if 'JAX_COMPILATION_CACHE_DIR' not in os.environ:   # set before JAX reads its flags
  if os.environ.get('CAPSJAX_TEST_JAX_CACHE', 'kept') == 'fresh':
    _cache_dir = tempfile.mkdtemp(prefix='capsjax-tests-jax-cache-')
    atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)   # the process that made it
  else:
    from capsjax.app.cli import cpu_folder_name  # pylint: disable=g-import-not-at-top  (JAX not imported)
    _cache_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), '.jax_cache', cpu_folder_name())
    # JAX's own size limit (jax_compilation_cache_max_size) locks and evicts across processes,
    # and its races surface as warnings in the commands' output that tests read: the run's
    # first process empties the folder instead, before any worker starts.
    if 'PYTEST_XDIST_WORKER' not in os.environ and _folder_bytes(_cache_dir) > CACHE_LIMIT_BYTES:
      shutil.rmtree(_cache_dir, ignore_errors=True)
  os.environ['JAX_COMPILATION_CACHE_DIR'] = _cache_dir
  os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0')

# Huge pages for the workers and subprocesses, as every capsjax command gives itself
# (capsjax.app.cli.huge_pages_environment; glibc reads the tunable at process start, so this
# process keeps 4 KiB pages; docs/results.md, "CPU speed").
from capsjax.app import cli as _cli  # pylint: disable=g-import-not-at-top,wrong-import-position
os.environ.update(_cli.huge_pages_environment() or {})
_cli.quiet_libtpu_environment()   # libtpu (the tpu extra, for capsjax.app.plan) silent on a machine without TPUs

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import pytest

# The experiments' configs are checked here as the command checks them: with the built-in
# programs registered (their sections: capsjax.defaults.register_section).
from capsjax.app import launch as _launch  # pylint: disable=g-import-not-at-top,wrong-import-position
_launch.registered_programs()

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:   # benchmarks/ (not installed) is importable by tests, from any directory
  sys.path.insert(0, ROOT)

MNIST_DIR = os.environ.get('CAPSJAX_MNIST_DIR', os.path.join(ROOT, '..', 'shared', 'data', 'mnist'))
MARKER = 'float32_matmuls'
COMPILE_BOUND = 'compile_bound'


def pytest_configure(config):
  config.addinivalue_line('markers', f'{MARKER}: run with full float32 matmuls and convolutions '
                          '(no TF32 on a GPU); for tests that compare formulations, members or a reference')
  config.addinivalue_line('markers', f'{COMPILE_BOUND}: on a CPU, XLA compiles without most optimisations '
                          '(jax_disable_most_optimizations, in-process and in the commands the test starts), '
                          'for tests whose time is compiling small programs run a few times')
  config.addinivalue_line('markers', 'peers: needs the PyTorch peer (the peers extra); skips where torch is not '
                          'installed, fails under CI=true (the stack without PyTorch deselects it: .ci/run)')
  config.addinivalue_line('markers', 'slow: trains, compiles a paper-size model or runs a program end to end '
                          '(CI runs every test; `-m "not slow"` is the quick loop while editing)')


@contextlib.contextmanager
def float32_matmuls():
  """Full float32 matmuls for every thread (jax.default_matmul_precision is per thread)."""
  previous = jax.config.jax_default_matmul_precision
  jax.config.update('jax_default_matmul_precision', 'highest')
  try:
    yield
  finally:
    jax.config.update('jax_default_matmul_precision', previous)


@contextlib.contextmanager
def little_optimisation():
  """XLA's cheap compilation on a CPU (JAX's `jax_disable_most_optimizations`): the modules
  marked compile_bound compile many small programs and run each a few times, so their time
  is compilation, which this shortens; the compiled steps run slower, so modules that train
  stay optimised (each module measured both ways when it was marked). It changes
  how hard XLA's backend optimises the code it emits, not the program (JAX's in-memory jit
  cache does not key on it: a function compiled on either side is reused as it is, correct
  either way). A GPU's compiles are left alone."""
  if jax.default_backend() != 'cpu':
    yield
    return
  previous = jax.config.values['jax_disable_most_optimizations']   # a flag: no attribute, no context manager
  jax.config.update('jax_disable_most_optimizations', True)
  with pytest.MonkeyPatch.context() as patch:
    patch.setenv('JAX_DISABLE_MOST_OPTIMIZATIONS', '1')   # the commands the test starts
    try:
      yield
    finally:
      jax.config.update('jax_disable_most_optimizations', previous)


def _marked(node, marker: str = MARKER) -> bool:
  return node is not None and node.get_closest_marker(marker) is not None


@contextlib.contextmanager
def _marked_contexts(node):
  with contextlib.ExitStack() as stack:
    if _marked(node):
      stack.enter_context(float32_matmuls())
    if _marked(node, COMPILE_BOUND):
      stack.enter_context(little_optimisation())
    yield


@pytest.fixture(autouse=True, scope='module')
def _module_markers(request):
  with _marked_contexts(request.node):
    yield


@pytest.fixture(autouse=True)
def _test_markers(request):
  with _marked_contexts(request.node):
    yield


@pytest.fixture(scope='session')
def mnist_dir():
  """$CAPSJAX_MNIST_DIR, ../shared/data/mnist, else downloaded once (capsjax.data.idx.find_mnist).
  Without any (a clone offline), the tests that need MNIST skip, saying which variable to
  set; under CI=true they fail, as CI must run them."""
  from capsjax.data.idx import find_mnist  # pylint: disable=g-import-not-at-top
  from capsjax.errors import DataError  # pylint: disable=g-import-not-at-top
  try:
    return find_mnist([MNIST_DIR])
  except DataError as e:
    if os.environ.get('CI', '').lower() == 'true':
      pytest.fail(str(e))
    pytest.skip(f'needs the MNIST IDX files: set CAPSJAX_MNIST_DIR to a folder of them ({e})')

# The tests that take 20 s or more on a 2-core CPU (call or fixture set-up, `--durations`):
# they train, compile paper-size models or run
# programs end to end. `python -m pytest -q -n 2 -m "not slow" tests` leaves them out (a quick loop
# while editing; CI runs every test). A test that grows slow joins this list.
SLOW = frozenset((
    'tests/test_ablation.py::test_ablation_command_writes_table_and_loss_figure',
    'tests/test_recipes.py::test_recipes_as_one_program_equal_each_recipe_alone_and_resume_bit_for_bit',
    'tests/test_ablation.py::test_one_member_of_the_vmapped_ensemble_trains_like_the_run_alone',
    'tests/test_affnist.py::test_affnist_command_reports_both_models_on_all_test_sets',
    'tests/test_affnist.py::test_training_stops_at_the_target_accuracy_and_stays_stopped',
    'tests/test_analyses.py::test_figures_command_on_a_trained_run',
    'tests/test_analyses.py::test_sweep_command_trains_every_variant_and_ranks_them',
    'tests/test_api.py::test_every_docstring_example_runs',
    'tests/test_datasets.py::test_each_new_experiment_trains_beyond_chance',
    'tests/test_datasets.py::test_ensemble_eval_step_sums_the_members_lengths',
    'tests/test_diagnostics.py::test_every_routing_says_whether_it_has_couplings_and_they_are_distributions_over_parents',
    'tests/test_explorer.py::test_command_serves_then_stops_on_ctrl_c_or_sigterm',
    'tests/test_explorer.py::test_example_is_the_model_encoding_of_the_test_image',
    'tests/test_explorer.py::test_multimnist_mode_decodes_the_two_capsules_separately',
    'tests/test_explorer.py::test_shipped_model_is_the_paper_model_and_classifies_its_test_sample',
    'tests/test_explorer_browser.py::test_a_run_of_100_classes_with_long_names_shows_every_class_named',
    'tests/test_gpu_readiness.py::test_capsnet_routing_loop_option_keeps_the_outputs',
    'tests/test_gpu_readiness.py::test_the_lease_s_speed_call_runs_every_row_on_the_cpu',
    'tests/test_images.py::test_another_tfds_builder_downloads_prepares_and_trains',
    'tests/test_images.py::test_image_folder_of_real_digits_trains_and_records_its_classes',
    'tests/test_images.py::test_predict_function_agrees_with_files',
    'tests/test_launch.py::test_a_program_stopped_inside_a_run_exits_75',
    'tests/test_models.py::test_bfloat16_conv_inputs_round_the_inputs_and_accumulate_in_float32',
    'tests/test_models.py::test_capsnet_formulations_agree',
    'tests/test_models.py::test_capsnet_with_bfloat16_conv_inputs_stays_close_to_float32',
    'tests/test_models.py::test_transposed_conv_equals_flax_conv_transpose_in_value_and_gradient',
    'tests/test_multimnist.py::test_baseline_cnn_trains_with_sigmoid_loss',
    'tests/test_multimnist.py::test_short_training_beats_chance',
    'tests/test_nnx.py::test_an_nnx_model_with_capsjax_layers_trains',
    'tests/test_plan.py::test_the_runs_own_step_compiles_for_a_tpu_slice_and_matches_hand_counts',
    'tests/test_recipes.py::test_a_run_with_the_recipe_options_resumes_bit_identical',
    'tests/test_recipes.py::test_the_moving_average_is_the_hand_update_of_the_parameters',
    'tests/test_recipes.py::test_seeds_with_validation_train_as_one_program_and_report_mean_std',
    'tests/test_registry.py::test_a_routing_from_its_own_file_trains_and_is_listed',
    'tests/test_routing.py::test_every_routing_drives_the_capsnet_and_its_loss',
    'tests/test_routing.py::test_explorer_and_predict_show_the_routings_activations',
    'tests/test_routing.py::test_routing_zoo_writes_a_row_per_algorithm',
    'tests/test_routing.py::test_shared_transforms_in_the_capsnet_route_without_votes_and_do_not_grow_with_the_image',
    'tests/test_routing.py::test_the_capsnet_routes_the_newer_algorithms_without_votes_too',
    'tests/test_sharding.py::test_sixteen_simulated_devices_train_and_evaluate_like_one',
    'tests/test_signals.py::test_ctrl_c_before_training_is_one_line',
    'tests/test_signals.py::test_ctrl_c_saves_and_the_run_resumes',
    'tests/test_sizing.py::test_deconv_decoder_gives_the_image_shape_in_unit_range',
    'tests/test_sizing.py::test_photos_train_with_the_chosen_model',
    'tests/test_sizing.py::test_predict_explorer_and_export_work_on_the_chosen_model',
    'tests/test_tfds.py::test_prepared_data_is_reused_without_network',
    'tests/test_tfds.py::test_prepared_tfds_data_equals_the_idx_files',
    'tests/test_tfds.py::test_readme_command_downloads_prepares_and_trains',
    'tests/test_torch_peer.py::test_the_peer_equals_capsjax_for_the_same_weights',
    'tests/test_train.py::test_a_damaged_newest_checkpoint_is_set_aside_and_the_run_resumes_from_an_intact_one',
    'tests/test_train.py::test_a_finished_run_says_so_and_reevaluates_only_when_asked',
    'tests/test_train.py::test_corrupt_checkpoint_is_reported_and_left_in_place',
    'tests/test_train.py::test_divergence_stops_with_step_named_and_checkpoint_kept',
    'tests/test_train.py::test_nan_from_the_first_step',
    'tests/test_train.py::test_resumed_run_equals_uninterrupted_run',
    'tests/test_train.py::test_short_training_learns_real_mnist',
    'tests/test_workdir.py::test_full_disk_is_one_line_through_run_py',
    # Out of the quick loop, for its 3-minute budget.
    'tests/test_workdir.py::test_metrics_hold_each_step_once_and_wall_time_adds_up',
    'tests/test_workdir.py::test_config_is_written_after_the_first_step_and_a_changed_config_is_refused',
    'tests/test_memory.py::test_the_estimate_is_close_to_what_xla_allocates_for_a_capsnet',
    'tests/test_registry.py::test_a_model_key_and_a_routing_option_are_one_declaration_each',
    'tests/test_train.py::test_the_fresh_state_sits_where_the_step_puts_it',
    'tests/test_routing.py::test_traced_iteration_count_under_vmap_matches_separate_calls',
    'tests/test_plan.py::test_a_stopped_plan_says_so_in_one_line',
    # Over 20 s (Zen 3: 42, 31 and 31 s with the compilation cache cold).
    'tests/test_export.py::test_a_trained_model_exports_to_files_that_compute_what_capsjax_computes',
    'tests/test_export.py::test_an_own_images_model_exports_and_agrees',
    'tests/test_gpu_readiness.py::test_a_gpu_training_leg_starts_is_waited_for_and_exported_on_the_cpu',
    'tests/test_slurm.py::test_srun_two_tasks_stopped_by_scancel_resume_and_train_like_one_process',
))


# Fixtures that train a run, prepare a dataset or serve a trained model (30 s or more to
# set up on a 2-core CPU, `--durations`): every test that uses one is slow too.
SLOW_FIXTURES = frozenset((
    'tests/test_images.py::trained', 'tests/test_tfds.py::prepared', 'tests/test_explorer.py::trained_workdir',
    'tests/test_explorer_browser.py::page', 'tests/test_plan.py::tiny_plan',
))


def pytest_collection_modifyitems(config, items):
  del config
  # Looked up once, not imported: PyTorch takes 5 s to import, which every worker would pay.
  without_torch = importlib.util.find_spec('torch') is None and os.environ.get('CI', '').lower() != 'true'
  for item in items:
    if without_torch and item.get_closest_marker('peers'):
      item.add_marker(pytest.mark.skip(reason="needs the PyTorch peer: pip install -e '.[peers]'"))
    module = item.nodeid.split('::')[0]
    if (item.nodeid.split('[')[0] in SLOW
        or any(f'{module}::{name}' in SLOW_FIXTURES for name in getattr(item, 'fixturenames', ()))):
      item.add_marker(pytest.mark.slow)
