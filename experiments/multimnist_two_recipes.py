"""MultiMNIST (section 6) as one GPU leg of about 11 minutes: two recipes × three seeds as
one vmapped program, ranked on validation pairs made of 10 000 held-out training digits
(training never sees them), the test pairs reported beside, never used to choose.

  python run.py --experiment=multimnist_two_recipes --workdir=W
  bash benchmarks/gpu.sh leg multimnist --experiment=multimnist_two_recipes   # on a GPU machine

The recipes (config.ensemble.recipes) and why:
  paper  the paper's MultiMNIST recipe: Adam 1e-3, exponential decay ×0.96 every 20 000
         steps (10× MNIST's period), the generator's ±4 px shifts. The reference.
  fast   mnist_fast's schedule (3e-3 after a 100-step warm-up, cosine to 1e-5 at the last
         step): MNIST's best recipe at a short GPU run's length (docs/results.md). Its affine
         augmentation does not apply here: the generator makes MultiMNIST's examples.
Each member keeps a moving average of its parameters (ema_decay 0.999, evaluated beside
them). results.json and table.md give the top-2 error (both digits among the two longest
capsules) per member and per recipe, each recipe's three seeds summed as one classifier
(`recipe_ensemble_test_error`), validation and test, with the pairs each member saw.

Length, an ESTIMATE (not a measurement): the MultiMNIST training step costs 1.84× MNIST's
per example on a 2-core Zen 3 (36 × 36 inputs and two reconstructions; measured
2026-11-27, docs/results.md "MultiMNIST"); the H200 trained 3 MNIST members at ≈ 65 000
images/s in all (bfloat16, 2026-11-26) and 12 (`mnist_four_recipes`, with their augmentation) at
52 900 (2026-11-28), so 6 MultiMNIST members ≈ 29 000–35 000 pairs/s there: 18 000 steps ×
128 × 6 = 13.8M pairs ≈ 6.6–8 minutes, plus ≈ 1.5 minutes of compilation and two
evaluations of 20 000 pairs × 6 members × 2 (raw and averaged parameters): ≈ 11 minutes, a
leg and its wait (docs/gpu.md). Each member sees 2.3M pairs (the longest MultiMNIST
training so far: 3.2M pairs, 12.1 % top-2 error). Both rates were measured with vmap's
grouped convolutions; the leg runs one per member (model.formulation.member_convs, 'auto'
on a GPU since 2026-11-28), ESTIMATED up to ≈ 1.8× faster (docs/results.md, "One
convolution per member"): the length stays sized from the measured rate.
"""
import ml_collections

from capsjax.experiments import multimnist

RECIPES = (
    'paper:',
    'fast: learning_rate=3e-3, lr_schedule="cosine", lr_min=1e-5, warmup_steps=100, warmup_max_fraction=0.25',
)


def get_config():
  config = multimnist.get_config()
  config.experiment = 'multimnist_two_recipes'
  config.ensemble = ml_collections.ConfigDict(dict(seeds=(0, 1, 2), recipes=RECIPES))
  config.validation_examples = 10000   # training digits held out: the validation pairs are theirs
  config.num_test_examples = 10000     # test pairs, and as many validation pairs
  config.num_steps = 18000
  config.eval_every_steps = 9000
  config.checkpoint_every_steps = 9000
  config.ema_decay = 0.999
  return config
