"""The model families, each a Flax module registered by name (`MODELS`): CapsNet (the paper's,
`capsnet`) and the CNN baselines (`cnn`); and the module built from a config's model
section (`build`).

- `base`: the registry, `register_model`, and what every family shares (its input shape
  and class count keys, the checks of a built module).
- `capsnet`, `cnn`: one family each, registering itself (registration order is
  MODELS.names()'s order).
- `build`: the section's keys and defaults, the rules it breaks, the module built from it.
"""
from capsjax.models.base import (INPUT_SHAPE, MODELS, NUM_CLASSES, Array, check_input_images, check_module,
                                 count_params, left_to_the_data, register_model)
from capsjax.models.capsnet import (DECODERS, INITS, STEMS, CapsNet, capsnet_geometry_problem, capsule_lengths,
                                    initializers, longest_capsule_mask, mask_capsules, primary_grid,
                                    routing_options_problems)
from capsjax.models.cnn import BaselineCNN
from capsjax.models.build import (build_model, formulation_of, model_config, model_for_platform, model_keys,
                                  model_problems)

__all__ = [
    'INPUT_SHAPE', 'MODELS', 'NUM_CLASSES', 'Array', 'check_input_images', 'check_module', 'count_params',
    'left_to_the_data', 'register_model',
    'DECODERS', 'INITS', 'STEMS', 'CapsNet', 'capsnet_geometry_problem', 'capsule_lengths', 'initializers',
    'longest_capsule_mask', 'mask_capsules', 'primary_grid', 'routing_options_problems',
    'BaselineCNN',
    'build_model', 'formulation_of', 'model_config', 'model_for_platform', 'model_keys', 'model_problems',
]
